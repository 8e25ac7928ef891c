"""The memory panel (SPEC section 10, seed 004): a small web application beside the agents.

``touba panel`` serves it on 127.0.0.1 over the same stores the agents use:
per-agent memory settings, users and their sessions, key events,
decision-history conversations and their reservations, extraction jobs, and a
preview chat. :func:`create_app` builds it over stores you opened.

Decisions (documented here because they are behaviour):

- **Auth.** One access token (random at start, or ``TOUBA_PANEL_TOKEN``),
  printed once as ``http://127.0.0.1:PORT/?token=...``. The first request
  carrying it is answered with a redirect to the same page without the
  token and an HttpOnly, SameSite=Strict session cookie (``Secure`` behind a
  TLS proxy); the token never appears in a later URL, and no log line holds
  a query string. Every page and action refuses without a live session
  (401, with a form to paste the token); comparisons are constant-time.
  Sessions live in the panel's memory (a restart logs everyone out), at most
  64, for 12 hours. The static CSS and JS are public (they hold no data).
- **Hosts.** Only loopback ``Host`` names are served (DNS rebinding is
  refused), unless the panel runs with ``--allow-remote`` behind TLS.
- **CSRF.** Every state-changing request is a POST carrying the session's
  CSRF token (form field ``csrf`` or header ``X-CSRF-Token``) and an
  ``Origin`` (or ``Referer``) naming the panel itself; anything else is
  refused with 403 and changes nothing.
- **Output.** Everything read from the stores (titles, details, turns, model
  text, arguments, results, identities) is untrusted and rendered escaped by
  Jinja2's autoescape. Headers: a Content-Security-Policy allowing only the
  panel's own script and stylesheet (no inline script, no inline style),
  ``X-Frame-Options: DENY``, ``nosniff``, and ``Cache-Control: no-store`` on
  every page.
- **What is editable.** An agent's memory settings (short-term turns with
  its switch, full context 0 to 5, the key-event switch and types),
  validated by ``MemoryConfig`` itself (its messages, next to the field),
  saved with ``store.save_memory_config(..., actor="operator")``: they win
  over the program's and reach every session at its next turn. Each change is
  recorded (before, after, when, by whom) and listed on the agent's page;
  "reset to the program's settings" deletes the saved ones behind a
  confirmation (a box the server checks), recorded too. A key event's status, title and
  details, recorded in its update history as made by the operator (session
  ``"panel"``). A failed extraction job can be requeued. An inactive
  conversation can be deleted. Turns and sessions are read-only.
- **What recover does.** It frees the reservation a crashed worker left on a
  conversation, behind a confirmation that repeats the seed's warning: stop
  and check the old worker first; this frees storage, it decides nothing
  about an uncertain business effect.
- **Preview.** The preview box runs a turn of the agent with
  ``mode="preview"``: blank memory, no key event read or written, stored in
  a preview session of its own. Capabilities run; a call that needs
  approval is refused (a preview approves nothing).
"""

from touba.panel._app import create_app

__all__ = ["create_app"]
