"""Auth, CSRF, origin and host checks, security headers: the panel refuses before it acts."""

from __future__ import annotations

import logging
import re

import pytest
from fastapi.testclient import TestClient

from tests.panel.conftest import BASE, ORIGIN, TOKEN, csrf_of, post
from touba.memory import SqliteMemoryStore
from touba.panel._auth import PanelAuth, same_origin

PAGES = (
    "/",
    "/agents/support",
    "/users",
    "/user?owner=user:alice",
    "/session?id=s-1",
    "/events?owner=user:alice",
    "/event?owner=user:alice&id=ke_1",
    "/conversations",
    "/conversation?key=th1:x:y",
    "/conversation/recover?key=th1:x:y",
    "/jobs",
    "/job?id=xj_1",
)
ACTIONS: tuple[tuple[str, dict[str, str]], ...] = (
    ("/agents/support/memory", {"short_term_on": "on", "short_term_turns": "3"}),
    ("/agents/support/preview", {"message": "hello"}),
    ("/agents/support/preview/stream", {"message": "hello"}),
    ("/event/edit", {"owner": "user:alice", "id": "ke_1", "title": "x"}),
    ("/conversation/recover", {"key": "th1:x:y", "worker_stopped": "yes"}),
    ("/conversation/delete", {"key": "th1:x:y"}),
    ("/jobs/requeue", {"id": "xj_1"}),
    ("/logout", {}),
)


@pytest.mark.parametrize("path", PAGES)
def test_every_page_refuses_without_the_token(anonymous: TestClient, path: str) -> None:
    response = anonymous.get(path)
    assert response.status_code == 401
    assert 'name="token"' in response.text  # a form to paste the token
    assert "touba_panel" not in response.headers.get("set-cookie", "")


@pytest.mark.parametrize(("path", "data"), ACTIONS)
def test_every_action_refuses_without_the_token(
    anonymous: TestClient, memory: SqliteMemoryStore, path: str, data: dict[str, str]
) -> None:
    response = anonymous.post(path, data={"csrf": "guess", **data}, headers=ORIGIN)
    assert response.status_code == 401


def test_a_wrong_token_is_refused(anonymous: TestClient) -> None:
    response = anonymous.get("/?token=" + "x" * len(TOKEN))
    assert response.status_code == 401
    assert "not valid" in response.text
    assert anonymous.get("/").status_code == 401


def test_the_token_becomes_an_httponly_strict_cookie_and_leaves_the_url(
    anonymous: TestClient,
) -> None:
    response = anonymous.get(f"/users?page=2&token={TOKEN}")
    assert response.status_code == 303
    assert response.headers["location"] == "/users?page=2"  # the token is gone from the URL
    cookie = response.headers["set-cookie"]
    assert cookie.startswith("touba_panel=")
    assert TOKEN not in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "Path=/" in cookie
    page = anonymous.get("/users?page=2")
    assert page.status_code == 200
    assert TOKEN not in page.text


def test_the_token_is_never_logged(anonymous: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        anonymous.get(f"/?token={TOKEN}")
        anonymous.get("/")
    served = [r.getMessage() for r in caplog.records if r.name.startswith("touba")]
    assert any("GET / 303" in line for line in served)
    assert all(TOKEN not in line for line in served)  # (the test client logs its own URLs)


def test_the_login_form_takes_the_token_with_an_origin(anonymous: TestClient) -> None:
    assert anonymous.post("/login", data={"token": TOKEN}).status_code == 403  # no Origin
    refused = anonymous.post("/login", data={"token": "nope"}, headers=ORIGIN)
    assert refused.status_code == 401
    response = anonymous.post("/login", data={"token": TOKEN}, headers=ORIGIN)
    assert response.status_code == 303
    assert anonymous.get("/").status_code == 200


def test_logout_ends_the_session(client: TestClient) -> None:
    response = post(client, "/logout", {})
    assert response.status_code == 303
    assert client.get("/").status_code == 401


def test_a_post_without_the_csrf_token_is_refused(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    data = {"short_term_on": "on", "short_term_turns": "3", "full_context_turns": "1"}
    for form in (data, {**data, "csrf": "not-the-token"}):
        response = client.post("/agents/support/memory", data=form, headers=ORIGIN)
        assert response.status_code == 403
        assert "CSRF" in response.text


def test_the_csrf_token_also_goes_as_a_header(client: TestClient) -> None:
    token = csrf_of(client)
    data = {"short_term_on": "on", "short_term_turns": "3", "full_context_turns": "1"}
    response = client.post(
        "/agents/support/memory", data=data, headers={**ORIGIN, "X-CSRF-Token": token}
    )
    assert response.status_code == 303


@pytest.mark.parametrize(
    "headers",
    [
        {},  # a POST with neither Origin nor Referer
        {"origin": "http://evil.example"},
        {"origin": "http://127.0.0.1:9999"},
        {"origin": "null"},
        {"referer": "http://evil.example/page"},
    ],
)
def test_a_cross_site_form_post_is_refused(client: TestClient, headers: dict[str, str]) -> None:
    data = {"csrf": csrf_of(client), "short_term_on": "on", "short_term_turns": "3"}
    response = client.post("/agents/support/memory", data=data, headers=headers)
    assert response.status_code == 403
    assert "nothing was changed" in response.text


def test_a_same_origin_referer_is_enough_without_origin(client: TestClient) -> None:
    data = {
        "csrf": csrf_of(client),
        "short_term_on": "on",
        "short_term_turns": "3",
        "full_context_turns": "1",
    }
    response = client.post(
        "/agents/support/memory", data=data, headers={"referer": BASE + "/agents/support"}
    )
    assert response.status_code == 303


def test_another_host_name_is_refused(client: TestClient) -> None:
    """DNS rebinding: a page of another site resolving to 127.0.0.1 names its own host."""
    assert client.get("/", headers={"host": "evil.example:8765"}).status_code == 400


def test_security_headers_on_every_response(client: TestClient, anonymous: TestClient) -> None:
    for response in (client.get("/"), client.get("/users"), anonymous.get("/")):
        headers = response.headers
        csp = headers["content-security-policy"]
        assert "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert "unsafe-eval" not in csp
        assert "frame-ancestors 'none'" in csp
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["cache-control"] == "no-store"
        assert headers["referrer-policy"] == "same-origin"


def test_pages_carry_no_inline_script_or_style(client: TestClient) -> None:
    for path in ("/", "/agents/support", "/users", "/events", "/conversations", "/jobs"):
        html = client.get(path).text
        assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", html) == []
        assert re.search(r"\son[a-z]+\s*=", html) is None
        assert " style=" not in html


def test_static_assets_are_served_by_the_panel(anonymous: TestClient) -> None:
    for path in ("/static/panel.css", "/static/panel.js"):
        response = anonymous.get(path)
        assert response.status_code == 200
        assert response.headers["x-content-type-options"] == "nosniff"


def test_token_and_csrf_comparisons() -> None:
    auth = PanelAuth("a" * 32)
    assert auth.token_matches("a" * 32)
    assert not auth.token_matches("a" * 31 + "b")
    assert not auth.token_matches(None)
    assert not auth.token_matches("")
    session = auth.login()
    assert auth.session(session.session_id) is session
    assert auth.session("forged") is None
    assert PanelAuth.csrf_matches(session, session.csrf)
    assert not PanelAuth.csrf_matches(session, session.csrf[:-1])
    with pytest.raises(ValueError, match="16 characters"):
        PanelAuth("short")


def test_origin_rule() -> None:
    host = "127.0.0.1:8765"
    assert same_origin("http://127.0.0.1:8765", None, host, https_allowed=False)
    assert not same_origin("https://127.0.0.1:8765", None, host, https_allowed=False)
    assert same_origin("https://127.0.0.1:8765", None, host, https_allowed=True)
    assert same_origin(None, "http://127.0.0.1:8765/x?y", host, https_allowed=False)
    assert not same_origin(None, None, host, https_allowed=False)
    assert not same_origin("http://127.0.0.1:8765", None, None, https_allowed=False)
