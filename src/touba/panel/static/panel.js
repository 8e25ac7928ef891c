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
  // With data-stream, the reply streams: server-sent events read from the fetch's body
  // (delta: text added with textContent; call: a tool line; done: the transcript the
  // server rendered and escaped).
  for (const form of document.querySelectorAll("form[data-fetch]")) {
    const target = document.querySelector(form.dataset.fetch);
    if (!target) continue;
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const button = form.querySelector("button");
      const field = form.querySelector("input[name=message]");
      if (button) button.disabled = true;
      try {
        if (form.dataset.stream && window.ReadableStream && window.TextDecoder) {
          await streamTurn(form, target, field ? field.value : "");
          if (field) field.value = "";
          return;
        }
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

// One streamed preview turn (see the preview form above).
async function streamTurn(form, target, message) {
  const response = await fetch(form.dataset.stream, {
    method: "POST",
    body: new FormData(form),
    headers: { "X-Touba-Fetch": "1", "Accept": "text/event-stream" },
    credentials: "same-origin",
  });
  const type = response.headers.get("content-type") || "";
  if (!response.ok || !response.body || !type.startsWith("text/event-stream")) {
    form.submit();  // the server's answer as a page (a refusal says why)
    return;
  }
  let log = target.querySelector("ol.chatlog");
  if (!log) {
    target.replaceChildren();
    log = document.createElement("ol");
    log.className = "chatlog";
    target.append(log);
  }
  const line = (kind, who, text) => {
    const item = document.createElement("li");
    item.className = kind;
    const label = document.createElement("span");
    label.className = "who";
    label.textContent = who;
    item.append(label, " ");
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    item.append(body);
    log.append(item);
    return body;
  };
  line("you", "you", message);
  let reply = null;
  const handle = (name, data) => {
    if (name === "delta") {
      if (!reply) reply = line("agent streaming", "agent", "");
      reply.textContent += data.text;
    } else if (name === "call") {
      reply = null;
      line("call", "tool", `${data.name} → ${data.status}`);
    } else if (name === "done") {
      target.innerHTML = data.html;  // the server escaped every value
    }
  };
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const field of block.split("\n")) {
        if (field.startsWith("event: ")) name = field.slice(7);
        else if (field.startsWith("data: ")) data.push(field.slice(6));
      }
      if (data.length) handle(name, JSON.parse(data.join("\n")));
    }
  }
}
