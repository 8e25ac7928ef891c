// touba memory panel: a little progressive enhancement. Every page works without it.
// Served by touba itself (CSP script-src 'self'); no inline script, no dependency.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  // Forms that ask first: <form data-confirm="...">.
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }

  // A number input that a switch enables: <input data-enabled-by="checkbox-id">.
  for (const input of document.querySelectorAll("input[data-enabled-by]")) {
    const box = document.getElementById(input.dataset.enabledBy);
    if (!box) continue;
    const sync = () => { input.readOnly = !box.checked; };
    box.addEventListener("change", sync);
    sync();
  }

  // "last N turns" next to the full-context field, as the seed names it.
  for (const out of document.querySelectorAll("output[data-shows]")) {
    const input = document.getElementById(out.dataset.shows);
    if (!input) continue;
    const show = () => {
      const n = Number(input.value);
      out.textContent = !Number.isInteger(n) || input.value === "" ? ""
        : n === 0 ? "off" : `last ${n} turn${n > 1 ? "s" : ""}`;
    };
    input.addEventListener("input", show);
    show();
  }

  // The preview chat: post with fetch and replace the transcript, no page reload.
  for (const form of document.querySelectorAll("form[data-fetch]")) {
    const target = document.querySelector(form.dataset.fetch);
    if (!target) continue;
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const button = form.querySelector("button");
      const field = form.querySelector("input[name=message]");
      if (button) button.disabled = true;
      try {
        const response = await fetch(form.action, {
          method: "POST",
          body: new FormData(form),
          headers: { "X-Touba-Fetch": "1" },
          credentials: "same-origin",
        });
        if (!response.ok) { form.submit(); return; }
        target.innerHTML = await response.text();  // the server escaped every value
        if (field) field.value = "";
      } finally {
        if (button) button.disabled = false;
        if (field) field.focus();
      }
    });
  }
});
