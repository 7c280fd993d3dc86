"""With no Hub, every refusal names what works offline (issue 54, point 1).

The network is really absent here: the endpoint is a loopback port where nothing listens (a refused
connection), a name the resolver cannot resolve (a DNS failure, made in-process by a resolver that fails as
one with no network does), or ``HF_HUB_OFFLINE=1``. Each path that needed the Hub must end with the same way
out (``zoo.hub.offline_routes``): the bundled copy with the exact call that loads it where a checkout has one,
else the checkpoint-folder route; and the route it names must then work with the endpoint still dead.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from huggingface_hub import constants

import zoo
from zoo import hub
from zoo.catalog import bundled_dir, canonical_name
from zoo.tools.ports import free_port

DEFAULT = canonical_name("default")
FOLDER = "zoo.load('path/to/folder')"


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """An empty Hub cache, no offline flag, and an endpoint where nothing listens."""
    for k in ("HF_HUB_OFFLINE", "ZOO_HUB", "HF_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    return endpoint


@pytest.fixture
def no_dns(monkeypatch):
    """Name resolution fails as on a machine with no network (loopback still resolves)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host not in {"127.0.0.1", "::1", "localhost", None}:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def bundled_route(name: str) -> str:
    return f"zoo.load({name!r}, source='bundled')"


def one_line(message: str) -> str:
    assert "\n" not in message.strip() and "Traceback" not in message
    return message


def test_refused_connection_names_the_bundled_copy_and_it_loads(no_hub):
    with pytest.raises(hub.HubError) as err:
        zoo.load("default", source="hub")
    message = one_line(str(err.value))
    assert message.startswith(f"cannot reach the Hub at {no_hub} (ConnectError")
    assert bundled_route(DEFAULT) in message and FOLDER in message
    assert f"zoo score {bundled_dir() / DEFAULT} ..." in message
    model = zoo.load(DEFAULT, source="bundled")  # the route it names, with the endpoint still dead
    assert model.source == "bundled"


def test_dns_failure_names_the_same_way_out(no_hub, no_dns, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.invalid")
    with pytest.raises(hub.HubError) as err:
        hub.download(DEFAULT, endpoint="https://hub.example.invalid")
    message = one_line(str(err.value))
    assert "cannot reach the Hub at https://hub.example.invalid" in message
    assert bundled_route(DEFAULT) in message and FOLDER in message


def test_without_a_bundled_copy_the_folder_route_is_named(no_hub, tmp_path, monkeypatch):
    """A wheel install: no bundled copies, so ``zoo.load(name)`` downloads, and a dead Hub names the folder route."""
    monkeypatch.setenv("ZOO_PRETRAINED_DIR", str(tmp_path / "none"))
    with pytest.raises(hub.HubError) as err:
        zoo.load("default")
    message = one_line(str(err.value))
    assert "cannot reach the Hub" in message and FOLDER in message and "source='bundled'" not in message
    with pytest.raises(hub.HubError) as err:  # a repo outside the catalogue
        zoo.load("hf-hub:someone/their-lm")
    assert "cannot reach the Hub" in str(err.value) and FOLDER in str(err.value)


def test_offline_flag_names_the_same_routes(no_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubError) as err:
        hub.download(DEFAULT)
    message = one_line(str(err.value))
    assert "HF_HUB_OFFLINE is set" in message and bundled_route(DEFAULT) in message and FOLDER in message
    assert hub.offline_routes(DEFAULT) in message and hub.offline_routes() == hub.FOLDER_ROUTE


def test_auto_falls_back_with_a_short_warning(no_hub, capsys):
    """Without an explicit Hub request a checkout uses its bundled copy; the warning gives the reason only."""
    assert hub.resolve(DEFAULT)[1] == "bundled"
    err = capsys.readouterr().err
    assert "cannot reach the Hub" in err and err.rstrip().endswith("using the bundled copy")
    assert FOLDER not in err


def test_cli_download_with_no_network_is_one_line_naming_the_bundled_copy(no_hub, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([sys.executable, "-m", "zoo.cli", "download", "default", "--local-dir",
                          str(tmp_path / "weights")], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("zoo: error: cannot reach the Hub")
    assert bundled_route(DEFAULT) in res.stderr and FOLDER in res.stderr
    folder = str(bundled_dir() / DEFAULT)  # the folder command it names scores with the endpoint still dead
    res = subprocess.run([sys.executable, "-m", "zoo.cli", "score", folder, "--text", "the company said"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ppl" in res.stdout, res.stderr
