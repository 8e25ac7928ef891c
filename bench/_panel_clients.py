"""The panel's clients of bench/load.py, in a process of their own (stdlib and httpx only).

Reads its configuration (one JSON line) on stdin, logs every client in with
the token, prints ``ready``, browses and operates for ``seconds``, then prints
its :class:`ClientsReport` as JSON. See bench/load.py for what each client does.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

AGENT = "support"
OWNER = "user:load-seed"
TOKEN = "load-bench-token-0123456789abcdef"  # noqa: S105 - a bench-only token
GRACE = 60.0  # seconds a short run may go on to fetch every page kind once
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class ClientsReport:
    """What the panel's clients saw: times per page kind, failures, the operator's edits."""

    client_ms: dict[str, list[float]] = field(default_factory=dict)
    server_ms: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    settings_saved: int = 0
    settings_reset: int = 0
    events_edited: int = 0
    seconds: float = 0.0

    def record(self, kind: str, began: float, response: Any) -> None:
        self.client_ms.setdefault(kind, []).append((time.perf_counter() - began) * 1000)
        timing = response.headers.get("server-timing", "")
        if "dur=" in timing:
            self.server_ms.setdefault(kind, []).append(float(timing.split("dur=")[1]))
        if not 200 <= response.status_code < 400:
            self.failures.append(f"{kind}: {response.status_code}")

    def requests(self) -> int:
        return sum(len(values) for values in self.client_ms.values())


async def _login(client: Any) -> None:
    response = await client.get(f"/?token={TOKEN}")
    if response.status_code != 303:
        raise RuntimeError(f"login answered {response.status_code}")


async def _browse(
    client: Any,
    urls: dict[str, list[str]],
    think: float,
    until: float,
    report: ClientsReport,
    first: int = 0,
    clients: int = 1,
) -> None:
    order = [(kind, url) for kind, listed in urls.items() for url in listed]
    # The first round starts where this client's share of the list does (so that a few
    # clients fetch every page early, even in a short run); the next ones are shuffled.
    start = first * len(order) // max(clients, 1)
    order = order[start:] + order[:start]
    kinds = set(urls)

    def going() -> bool:  # until the end, and past it until every page kind was fetched
        now = time.perf_counter()
        return now < until or (now < until + GRACE and not kinds <= set(report.client_ms))

    if think:  # browsers arrive on their own, not all in the same millisecond
        await asyncio.sleep(random.uniform(0, 2 * think))
    while going():
        for kind, url in order:
            if not going():
                return
            began = time.perf_counter()
            try:
                response = await client.get(url)
            except Exception as e:  # a transport error is a failed request too
                report.failures.append(f"{kind}: {type(e).__name__}")
                continue
            report.record(kind, began, response)
            if think:
                await asyncio.sleep(random.uniform(0, 2 * think))
        random.shuffle(order)


async def _post(
    client: Any, kind: str, url: str, form: dict[str, str], report: ClientsReport
) -> bool:
    began = time.perf_counter()
    try:
        response = await client.post(url, data=form, headers={"origin": str(client.base_url)})
    except Exception as e:
        report.failures.append(f"{kind}: {type(e).__name__}")
        return False
    report.record(kind, began, response)  # a 4xx or 5xx is counted there
    if response.status_code == 303:
        return True
    if response.status_code < 400:  # the form shown again, unsaved
        report.failures.append(f"{kind}: {response.status_code}, not the 303 of a saved form")
    return False


async def _csrf(client: Any, kind: str, url: str, report: ClientsReport) -> str | None:
    began = time.perf_counter()
    try:
        response = await client.get(url)
    except Exception as e:
        report.failures.append(f"{kind}: {type(e).__name__}")
        return None
    report.record(kind, began, response)
    found = _CSRF.search(response.text)
    if found is None:
        report.failures.append(f"{kind}: no CSRF token on the page")
    return found.group(1) if found else None


async def _operate(
    client: Any, seeded: dict[str, Any], think: float, until: float, report: ClientsReport
) -> None:
    agent_url = f"/agents/{AGENT}"
    event_id = seeded["events"][0]
    event_url = f"/event?{urlencode({'owner': OWNER, 'id': event_id})}"
    round_ = 0
    while time.perf_counter() < until:
        round_ += 1
        csrf = await _csrf(client, "/agents/{name}", agent_url, report)
        if csrf is None:
            return
        if round_ % 5 == 0:
            form = {"csrf": csrf, "confirm": "yes"}
            if await _post(
                client, "POST reset settings", f"{agent_url}/memory/reset", form, report
            ):
                report.settings_reset += 1
        else:
            turns = "20" if round_ % 2 else "30"
            form = {
                "csrf": csrf,
                "short_term_on": "on",
                "short_term_turns": turns,
                "full_context_turns": "1",
                "types": "",
            }
            if await _post(client, "POST settings", f"{agent_url}/memory", form, report):
                report.settings_saved += 1
        csrf = await _csrf(client, "/event", event_url, report)
        if csrf is None:
            return
        form = {
            "csrf": csrf,
            "owner": OWNER,
            "id": event_id,
            "status": "in_progress" if round_ % 2 else "open",
            "title": "Case 0",
            "details": f"details of case 0, edited in round {round_}",
        }
        if await _post(client, "POST event edit", "/event/edit", form, report):
            report.events_edited += 1
        await asyncio.sleep(random.uniform(0, 2 * think) if think else 0.05)


async def run_clients(config: dict[str, Any]) -> ClientsReport:
    """The browsers and the operator, for ``config['seconds']`` after every login."""
    import httpx

    report = ClientsReport()
    limits = httpx.Limits(max_connections=4)
    timeout = httpx.Timeout(30.0)
    clients = [
        httpx.AsyncClient(base_url=config["base"], limits=limits, timeout=timeout)
        for _ in range(config["clients"] + 1)
    ]
    try:
        for client in clients:
            await _login(client)
        print("ready", flush=True)
        began = time.perf_counter()
        until = began + config["seconds"]
        async with asyncio.TaskGroup() as group:
            group.create_task(
                _operate(clients[0], config["seeded"], config["think"], until, report)
            )
            browsers = clients[1:]
            for number, client in enumerate(browsers):
                group.create_task(
                    _browse(
                        client,
                        config["urls"],
                        config["think"],
                        until,
                        report,
                        number,
                        len(browsers),
                    )
                )
        report.seconds = time.perf_counter() - began
    finally:
        for client in clients:
            await client.aclose()
    return report


def main() -> None:
    config = json.loads(sys.stdin.readline())
    report = asyncio.run(run_clients(config))
    print(json.dumps(report.__dict__))


if __name__ == "__main__":
    main()
