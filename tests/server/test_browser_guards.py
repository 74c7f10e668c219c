"""What a web page can do to a server on localhost: nothing. POST bodies must be declared JSON
(test_errors.py), the Host header must name this machine (DNS rebinding), /props keeps the
model's path to itself unless told, CORS refusals are JSON; and small HTTP courtesies (HEAD)."""

from __future__ import annotations

import httpx
import pytest

from server.planning import ServerOptions
from tests.server.test_security import call

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "LOCALHOST.evil.example:80"])
def test_a_foreign_host_name_is_refused(live_server, host):
    """A page on a domain that its owner points at 127.0.0.1 is same-origin with the server; its
    requests carry that domain in Host."""
    for method, path, kw in (("GET", "/props", {}), ("GET", "/v1/models", {}),
                             ("POST", "/v1/chat/completions", {"json": {"messages": MSG, "max_tokens": 1}})):
        r = httpx.request(method, live_server.base_url + path, headers={"Host": host}, timeout=60, **kw)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed" and "--allowed-host" in err["message"]


def test_this_machine_ip_addresses_and_allowed_names_are_accepted(live_server):
    for host in ("localhost", "localhost:8000", "127.0.0.1:1234", "[::1]:8000", "10.1.2.3", "app.localhost:3000",
                 "LocalHost"):
        assert httpx.get(live_server.base_url + "/v1/models", headers={"Host": host}, timeout=60).status_code == 200
    assert httpx.get(live_server.base_url + "/health", headers={"Host": "lb.internal"}).status_code == 200
    named = ServerOptions(allowed_hosts=("mybox.lan",))
    assert call(live_server, named, "GET", "/v1/models", headers={"Host": "mybox.lan:8000"}).status_code == 200
    assert call(live_server, named, "GET", "/v1/models", headers={"Host": "other.lan"}).status_code == 403
    anything = ServerOptions(check_host=False)
    assert call(live_server, anything, "GET", "/v1/models", headers={"Host": "evil.example"}).status_code == 200


def test_props_shows_the_model_name_not_its_path(live_server):
    props = httpx.get(live_server.base_url + "/props").json()
    path = live_server.bridge.engine.config.model_path
    assert props["model_path"] == live_server.model_id and path not in httpx.get(live_server.base_url + "/props").text
    shown = call(live_server, ServerOptions(show_model_path=True), "GET", "/props").json()
    assert shown["model_path"] == path


def test_a_refused_cors_preflight_is_json(live_server):
    opts = ServerOptions(cors_origins=("http://app.example",))
    r = call(live_server, opts, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "origin" in err["message"].lower()


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/v1/models", "/props"])
def test_head_works_where_get_does(live_server, path):
    r = httpx.head(live_server.base_url + path, timeout=60)
    assert r.status_code == 200 and r.content == b""


def test_duplicate_logit_bias_keys_are_refused(live_server):
    """"5" and "05" name one token: summed, they went past the +-100 bound."""
    r = httpx.post(live_server.base_url + "/v1/chat/completions", timeout=60,
                   json={"messages": MSG, "max_tokens": 1, "logit_bias": {"5": 100, "05": 100}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
