"""The Hub: downloads from a real Hub-compatible server (olah on 127.0.0.1), the cache, integrity, publishing.

Publishing runs the real ``HfApi`` with only its HTTP layer replaced (``huggingface_hub``'s client
factory given an ``httpx2.MockTransport``): no writable Hub exists here and olah is read-only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import socket
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import ModelCard, constants
from huggingface_hub.utils import _http

import zoo
from tests.olah_fixture import (
    OLAH_CLI,
    Olah,
    add_catalog_alias,
    bundle_into,
    make_mirror,
    real_default_bundle,
    run_main,
    tiny_run,
    zoo_cli,
)
from zoo import hub
from zoo.tools.ports import free_port
from zoo.tools.release import cards, publish

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Fail any in-process attempt to resolve or reach a host other than loopback (house rule: no network).

    huggingface_hub's telemetry (user agent: torch version, agent detection) would GET
    ``<HF endpoint at import>/api/agent-harnesses``; it is switched off as users would with HF_HUB_DISABLE_TELEMETRY.
    """
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo
    attempts: list[str] = []  # recorded too: libraries may swallow the error

    def connect(sock, address):
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            attempts.append(f"connect {address}")
            raise OSError(f"test guard: non-loopback connection to {address}")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and host not in LOOPBACK:
            attempts.append(f"lookup {host}")
            raise OSError(f"test guard: non-loopback name lookup of {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    yield
    assert attempts == []


@pytest.fixture(scope="module")
def pkg(tmp_path_factory) -> Path:
    """A temp package whose model ``tiny-zoo`` is the real default when it is bundled, else a tiny real run.

    Aliases of it point at broken Hub repos (tampered weights, a missing file, no repo).
    """
    pkg = tmp_path_factory.mktemp("hubpkg")
    real = real_default_bundle()
    if real:
        _, entry, folder = real
        shutil.copytree(folder, pkg / "pretrained" / "tiny-zoo")
        cat = {"default": None, "models": {"tiny-zoo": dict(entry, repo_id="alstm-zoo/tiny-zoo", revision="v1.0")}}
        (pkg / "catalog.json").write_text(json.dumps(cat))
    else:
        bundle_into(pkg, tiny_run(tmp_path_factory.mktemp("tiny-run")), "tiny-zoo")
    add_catalog_alias(pkg, "tiny-tampered", "tiny-zoo", "alstm-zoo/tiny-tampered")
    add_catalog_alias(pkg, "tiny-missing", "tiny-zoo", "alstm-zoo/tiny-missing")
    add_catalog_alias(pkg, "tiny-nowhere", "tiny-zoo", "alstm-zoo/tiny-nowhere")
    (pkg / "empty").mkdir()
    return pkg


@pytest.fixture(scope="module")
def olah(pkg, tmp_path_factory):
    """olah serving git repos built from the bundled tiny model: intact, tampered weights, a missing file."""
    if not OLAH_CLI.exists():
        pytest.skip(".venv-olah is absent (create it with `make olah`): no Hub-compatible server to test against")
    work = tmp_path_factory.mktemp("olah")
    files = {p.name: p.read_bytes() for p in (pkg / "pretrained" / "tiny-zoo").iterdir()}
    commits = {"tiny-zoo": make_mirror(work / "mirrors", "alstm-zoo/tiny-zoo", files)}
    tampered = dict(files)
    w = bytearray(files["model.safetensors"])
    w[-2] ^= 0x01  # one weight changes; still a valid safetensors file
    tampered["model.safetensors"] = bytes(w)
    make_mirror(work / "mirrors", "alstm-zoo/tiny-tampered", tampered)
    make_mirror(work / "mirrors", "alstm-zoo/tiny-missing", {k: v for k, v in files.items() if k != "vocab.json"})
    # a compatible repo published by someone else (no catalogue entry), and a repo that is not a zoo checkpoint
    commits["someone/their-lm"] = make_mirror(work / "mirrors", "someone/their-lm", files)
    make_mirror(work / "mirrors", "someone/not-a-zoo-model", {"README.md": b"# hello\n"})
    server = Olah(work, work / "mirrors")
    try:
        yield {"endpoint": server.endpoint, "commits": commits}
    finally:
        server.stop()


@pytest.fixture
def env(pkg, tmp_path, monkeypatch):
    """In-process settings: the temp catalogue, no bundled copies, an empty Hub cache, no Hub opt-in."""
    for k in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "ZOO_HUB", "HF_HOME"):
        monkeypatch.delenv(k, raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, when first imported: a value another module of the session
    # had set by then must not make these tests offline
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    values = {"ZOO_CATALOG": str(pkg / "catalog.json"), "ZOO_PRETRAINED_DIR": str(pkg / "empty"),
              "HF_HUB_CACHE": str(tmp_path / "cache")}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


def dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def cache_repo(cache: str | Path, name: str) -> Path:
    return Path(cache) / f"models--alstm-zoo--{name}"


# -- downloads against olah ------------------------------------------------------------------------------------
def test_load_by_name_downloads_verifies_then_second_load_is_cache_only(olah, env, pkg, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    model = zoo.load("tiny-zoo")
    assert model.source == "hub download" and model.name == "tiny-zoo"
    snap = cache_repo(env["HF_HUB_CACHE"], "tiny-zoo") / "snapshots" / olah["commits"]["tiny-zoo"]
    assert model.directory == snap
    ref = zoo.load(pkg / "pretrained" / "tiny-zoo")
    text = "the company said it expects a loss"
    assert model.score(text).texts[0]["nll"] == ref.score(text).texts[0]["nll"]
    # the second load: offline, the endpoint dead, from the cache, hashes checked again
    res = zoo_cli("info", "tiny-zoo", "--json", env={**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": dead_endpoint()})
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["source"] == "hub cache" and info["directory"] == str(snap)
    assert zoo.load("tiny-zoo").source == "hub cache"


def test_download_by_tag_and_commit_and_local_dir(olah, env, pkg, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    code, out, err = run_main(capsys, "download", "tiny-zoo", "--revision", "v1.0")
    assert code == 0, err
    snap = cache_repo(env["HF_HUB_CACHE"], "tiny-zoo") / "snapshots" / olah["commits"]["tiny-zoo"]
    n_files = len(json.loads((pkg / "catalog.json").read_text())["models"]["tiny-zoo"]["files"])
    assert out == (f"tiny-zoo: alstm-zoo/tiny-zoo@v1.0 from the download, sha256 verified for {n_files} files "
                   f"-> {snap}\n")
    code, out, _ = run_main(capsys, "download", "tiny-zoo")  # by name: the pinned tag, now from the cache
    assert code == 0 and "@v1.0 from the cache" in out
    commit = olah["commits"]["tiny-zoo"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache2"))
    code, out, err = run_main(capsys, "download", "tiny-zoo", "--revision", commit, "--local-dir",
                              str(tmp_path / "copy"))
    assert code == 0, err
    files = json.loads((pkg / "catalog.json").read_text())["models"]["tiny-zoo"]["files"]
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(files)
    assert {"README.md", "config.json", "model.safetensors", "vocab.json"} <= set(files)
    assert zoo.load(tmp_path / "copy").source == "local path"
    code, _, err = run_main(capsys, "download", "tiny-zoo", "--revision", "v9.9")
    assert code == 2 and err.splitlines()[-1].startswith("zoo: error: ")
    assert "v9.9" in err.splitlines()[-1] and "not found" in err.splitlines()[-1]


def test_sha256_mismatch_is_refused_leaving_nothing_behind(olah, env, tmp_path):
    e = {**env, "HF_ENDPOINT": olah["endpoint"]}
    res = zoo_cli("download", "tiny-tampered", "--local-dir", str(tmp_path / "target"), env=e)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("zoo: error: sha256 mismatch for model.safetensors of tiny-tampered")
    assert not cache_repo(env["HF_HUB_CACHE"], "tiny-tampered").exists()
    assert not (tmp_path / "target").exists() and list(tmp_path.glob(".target*")) == []
    with pytest.raises(hub.IntegrityError, match="sha256 mismatch"):
        hub.download("tiny-tampered", endpoint=olah["endpoint"])
    assert not cache_repo(env["HF_HUB_CACHE"], "tiny-tampered").exists()


def test_missing_file_is_refused(olah, env, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    code, _, err = run_main(capsys, "download", "tiny-missing")
    assert code == 2 and "has no file 'vocab.json'" in err.splitlines()[-1]
    assert not cache_repo(env["HF_HUB_CACHE"], "tiny-missing").exists()


def test_unknown_repository_is_a_clear_error(olah, env, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    code, _, err = run_main(capsys, "download", "tiny-nowhere")
    assert code == 2 and err.count("\n") == 1
    assert "repository alstm-zoo/tiny-nowhere (revision v1.0) not found" in err


def test_discarding_a_snapshot_deletes_only_its_own_blobs(tmp_path):
    """A snapshot entry that links outside the repo's blobs (a shared or tampered cache) is unlinked, never
    followed: discarding a bad revision must not delete a file elsewhere."""
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "blobs" / "b1").write_text("blob")
    victim = tmp_path / "victim.txt"
    victim.write_text("not the cache's")
    (snap / "model.safetensors").symlink_to(repo / "blobs" / "b1")
    (snap / "config.json").symlink_to(victim)
    hub.discard_snapshot(tmp_path, "org/m", "a" * 40)
    assert victim.read_text() == "not the cache's" and not snap.exists()
    assert not (repo / "blobs" / "b1").exists()


def test_corrupted_cache_is_detected_and_fetched_again(olah, env):
    folder, source = hub.download("tiny-zoo", endpoint=olah["endpoint"])
    assert source == "hub download"
    blob = (folder / "vocab.json").resolve()
    blob.write_bytes(blob.read_bytes()[:-3])
    rel = hub.release("tiny-zoo")
    assert hub.find_in_cache(rel) is None  # refused and removed
    assert not blob.exists()
    folder2, source2 = hub.download("tiny-zoo", endpoint=olah["endpoint"])
    assert source2 == "hub download" and hub.find_in_cache(rel) == folder2


# -- errors without a server, resolution order -------------------------------------------------------------------
def test_server_down_is_one_line_and_auto_falls_back_to_bundled(env, pkg, capsys, monkeypatch):
    down = {**env, "HF_ENDPOINT": dead_endpoint()}
    res = zoo_cli("download", "tiny-zoo", env=down)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("zoo: error: cannot reach the Hub at http://127.0.0.1:")
    monkeypatch.setenv("HF_ENDPOINT", down["HF_ENDPOINT"])
    monkeypatch.setenv("ZOO_PRETRAINED_DIR", str(pkg / "pretrained"))
    code, out, err = run_main(capsys, "info", "tiny-zoo", "--json")
    assert code == 0, err
    assert json.loads(out)["source"] == "bundled" and "using the bundled copy" in err
    with pytest.raises(hub.HubError, match="cannot reach the Hub"):  # asking for the Hub explicitly: no fallback
        zoo.load("tiny-zoo", source="hub")


def test_offline_with_empty_cache_and_no_bundled_copy_says_how_to_get_it(env, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", dead_endpoint())
    code, _, err = run_main(capsys, "info", "tiny-zoo")
    assert code == 2 and err.count("\n") == 1
    assert "has no bundled copy and is not in the Hub cache" in err
    assert "unset HF_HUB_OFFLINE and run `zoo download tiny-zoo`" in err
    assert "load a checkpoint folder you already have" in err  # the route that needs no Hub
    code, _, err = run_main(capsys, "download", "tiny-zoo")
    assert code == 2 and "HF_HUB_OFFLINE is set" in err and "zoo.load('path/to/folder')" in err


def test_resolution_order(env, pkg, monkeypatch):
    local = pkg / "pretrained" / "tiny-zoo"
    assert hub.resolve(local) == (local, "local path")
    with pytest.raises(zoo.zoo_model.ModelNotFoundError, match="not a checkpoint directory"):
        hub.resolve(pkg / "nothing-here")
    with pytest.raises(zoo.zoo_model.ModelNotFoundError, match="unknown model 'nope'"):
        hub.resolve("nope")
    monkeypatch.setenv("ZOO_PRETRAINED_DIR", str(pkg / "pretrained"))
    # no Hub opt-in: the bundled copy, and no connection attempt (the endpoint is not even set)
    assert hub.resolve("tiny-zoo") == (local, "bundled")
    # a verified copy in the Hub cache comes before the bundled one (planted, as a download would)
    snap = Path(env["HF_HUB_CACHE"]) / "models--alstm-zoo--tiny-zoo" / "snapshots" / ("ab" * 20)
    shutil.copytree(local, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "v1.0").write_text("ab" * 20)
    assert hub.resolve("tiny-zoo") == (snap, "hub cache")
    assert hub.resolve("tiny-zoo", source="bundled") == (local, "bundled")
    # a folder in the working directory named like a catalogue model, but no checkpoint, does not hide the model
    # (`zoo export NAME --out NAME` makes one); as a path, or for a name outside the catalogue, it is refused
    monkeypatch.chdir(pkg)
    (pkg / "tiny-zoo").mkdir()
    (pkg / "nope").mkdir()
    assert hub.resolve("tiny-zoo", source="bundled") == (local, "bundled")
    with pytest.raises(zoo.zoo_model.ModelNotFoundError, match="not a checkpoint directory"):
        hub.resolve("./tiny-zoo")
    with pytest.raises(zoo.zoo_model.ModelNotFoundError, match="nope: not a checkpoint directory"):
        hub.resolve("nope")
    with pytest.raises(ValueError, match="source must be one of"):
        hub.resolve("tiny-zoo", source="ftp")


# -- publishing through HfApi with a stub HTTP transport ---------------------------------------------------------
class HubStub:
    """The Hub's write API as seen over HTTP: records every request, stores uploaded LFS objects."""

    def __init__(self, fail_tag: bool = False):
        self.requests: list[tuple[str, str]] = []
        self.lfs: dict[str, bytes] = {}
        self.commit_lines: list[dict] = []
        self.tags: list[tuple[str, dict]] = []
        self.auth: set[str] = set()
        self.fail_tag = fail_tag

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path, method = request.url.path, request.method
        self.requests.append((method, path))
        self.auth.add(request.headers.get("authorization", ""))
        if method == "POST" and path == "/api/repos/create":
            body = json.loads(request.content)
            return httpx2.Response(200, json={"url": f"http://hub.test/{body['organization']}/{body['name']}"})
        if method == "POST" and path == "/api/validate-yaml":
            ModelCard(json.loads(request.content)["content"])  # the card must parse
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        if method == "POST" and "/preupload/" in path:
            files = json.loads(request.content)["files"]
            return httpx2.Response(200, json={"files": [
                {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith((".safetensors", ".onnx", ".pt"))
                 else "regular", "shouldIgnore": False} for f in files]})
        if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            objs = json.loads(request.content)["objects"]
            return httpx2.Response(200, json={"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"],
                 "actions": {"upload": {"href": f"http://hub.test/lfs-upload/{o['oid']}"}}} for o in objs]})
        if method == "PUT" and path.startswith("/lfs-upload/"):
            self.lfs[path.rsplit("/", 1)[1]] = request.read()
            return httpx2.Response(200)
        if method == "POST" and "/commit/" in path:
            self.commit_lines = [json.loads(x) for x in request.content.decode().splitlines()]
            return httpx2.Response(200, json={"commitUrl": "http://hub.test/org/x/commit/" + "c" * 40,
                                              "commitOid": "c" * 40})
        if method == "POST" and "/tag/" in path:
            self.tags.append((path, json.loads(request.content)))
            return httpx2.Response(409 if self.fail_tag else 200, json={"error": "tag exists"} if self.fail_tag else {})
        return httpx2.Response(404, json={"error": f"unexpected {method} {path}"})


@pytest.fixture
def hub_stub(monkeypatch):
    stubs = []

    def install(**kw) -> HubStub:
        stub = HubStub(**kw)
        stubs.append(stub)
        _http.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(stub), follow_redirects=True,
                                                       event_hooks={"request": [_http.hf_request_event_hook]}))
        return stub

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # hf_xet uploads bypass the HTTP client
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield install
    _http.set_client_factory(_http.default_client_factory)


@pytest.fixture
def publish_pkg(pkg, tmp_path, monkeypatch):
    """A copy of the temp package (publishing rewrites the catalogue) with exports beside it."""
    p = tmp_path / "pkg"
    shutil.copytree(pkg, p)
    exports = tmp_path / "exports" / "tiny-zoo"  # the layout `zoo export` writes, made from the bundled weights
    weights = json.loads((p / "catalog.json").read_text())["models"]["tiny-zoo"]["files"]["model.safetensors"]
    for fmt, fname, data in (("onnx", "model_step.onnx", b"onnx-bytes" * 50), ("torchscript", "model.pt", b"ts" * 40)):
        (exports / fmt).mkdir(parents=True)
        (exports / fmt / fname).write_bytes(data)
        (exports / fmt / "export.json").write_text(json.dumps({"format": fmt, "checkpoint_sha256": weights["sha256"]}))
    (exports / "notes.txt").write_text("not an export: left out")
    # what zoo.files.write_atomic leaves when its process is killed between write and rename: never uploaded
    (exports / "onnx" / ".export.json.k3j9x1.tmp").write_text('{"half": ')
    for k in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "ZOO_PRETRAINED_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ZOO_CATALOG", str(p / "catalog.json"))
    return p, tmp_path / "exports"


EXPORTED = ["onnx/export.json", "onnx/model_step.onnx", "torchscript/export.json", "torchscript/model.pt"]


def test_publish_dry_run_prints_exactly_what_would_be_uploaded(publish_pkg, capsys, monkeypatch):
    p, exports = publish_pkg
    monkeypatch.setenv("HF_ENDPOINT", dead_endpoint())
    code, out, err = run_main(capsys, "publish", "tiny-zoo", "--repo-id", "someorg/tiny", "--dry-run",
                              "--exports-dir", str(exports))
    assert code == 0, err
    files = json.loads((p / "catalog.json").read_text())["models"]["tiny-zoo"]["files"]
    lines = out.splitlines()
    assert lines[0].startswith(f"would upload {len(files) + len(EXPORTED)} files")
    assert "someorg/tiny" in lines[0] and "tag 'v1.0'" in lines[0]
    listed = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert sorted(listed) == sorted([*files, *EXPORTED])
    for fname, meta in files.items():
        assert listed[fname][1] == f"{meta['size']:,}" and listed[fname][3] == meta["sha256"]
    onnx = exports / "tiny-zoo" / "onnx" / "model_step.onnx"
    assert listed["onnx/model_step.onnx"][3] == hashlib.sha256(onnx.read_bytes()).hexdigest()
    assert json.loads((p / "catalog.json").read_text())["models"]["tiny-zoo"]["repo_id"] == "alstm-zoo/tiny-zoo"


def test_publish_finds_exports_where_zoo_export_writes_them(publish_pkg, tmp_path, monkeypatch):
    """Without --exports-dir, publish reads the folder `zoo export` writes to ($ZOO_EXPORTS_DIR, else the user's
    data folder), the same function saying where for both."""
    p, exports = publish_pkg

    def exported() -> list[str]:
        return sorted(u.path_in_repo for u in publish.publish_plan("tiny-zoo") if exports in u.local.parents)

    monkeypatch.setenv("ZOO_EXPORTS_DIR", str(exports))
    assert exported() == EXPORTED
    monkeypatch.delenv("ZOO_EXPORTS_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data-home"))
    assert exported() == []
    (tmp_path / "data-home" / "alstm-zoo").mkdir(parents=True)
    exports.rename(tmp_path / "data-home" / "alstm-zoo" / "exports")
    exports = tmp_path / "data-home" / "alstm-zoo" / "exports"
    assert exported() == EXPORTED


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # inside huggingface_hub's LFS PUT
def test_publish_makes_one_commit_and_tags_it(publish_pkg, hub_stub, capsys):
    p, exports = publish_pkg
    stub = hub_stub()
    out = publish.publish("tiny-zoo", "someorg/tiny", exports_dir=exports, endpoint="http://hub.test")
    assert out["commit"] == "c" * 40 and out["tag"] == "v1.0"
    files = json.loads((p / "catalog.json").read_text())["models"]["tiny-zoo"]["files"]
    bundled = p / "pretrained" / "tiny-zoo"
    header, *ops = stub.commit_lines
    assert header["key"] == "header" and header["value"]["summary"].startswith("tiny-zoo v1.0")
    by_path = {op["value"]["path"]: op for op in ops}
    assert sorted(by_path) == sorted([*files, *EXPORTED])
    for fname, meta in files.items():
        op = by_path[fname]
        if fname.endswith(".safetensors"):
            assert op["key"] == "lfsFile" and op["value"]["oid"] == meta["sha256"]
            assert op["value"]["size"] == meta["size"]
            assert hashlib.sha256(stub.lfs[meta["sha256"]]).hexdigest() == meta["sha256"]
        else:
            assert op["key"] == "file"
            data = base64.b64decode(op["value"]["content"])
            assert len(data) == meta["size"] and hashlib.sha256(data).hexdigest() == meta["sha256"]
    onnx = (exports / "tiny-zoo" / "onnx" / "model_step.onnx").read_bytes()
    assert by_path["onnx/model_step.onnx"]["value"] == {"path": "onnx/model_step.onnx", "algo": "sha256",
                                                        "oid": hashlib.sha256(onnx).hexdigest(), "size": len(onnx)}
    manifest = by_path["torchscript/export.json"]
    assert manifest["key"] == "file" and json.loads(base64.b64decode(manifest["value"]["content"])) == {
        "format": "torchscript", "checkpoint_sha256": files["model.safetensors"]["sha256"]}
    card = base64.b64decode(by_path["README.md"]["value"]["content"]).decode()
    assert card == (bundled / "README.md").read_text()
    entry = json.loads((p / "catalog.json").read_text())["models"]["tiny-zoo"]
    assert cards.catalog_metrics_from_card(card, entry["dataset"]) == entry["metrics"]
    assert stub.tags == [(f"/api/models/someorg/tiny/tag/{'c' * 40}", {"tag": "v1.0",
                                                                        "message": "tiny-zoo release v1.0"})]
    writes = [r for r in stub.requests if r[0] != "GET"]  # (huggingface_hub may also GET its own metadata)
    assert writes[:4] == [("POST", "/api/repos/create"), ("POST", "/api/validate-yaml"),
                          ("POST", "/api/models/someorg/tiny/preupload/main"),
                          ("POST", "/someorg/tiny.git/info/lfs/objects/batch")]
    assert sorted(writes[4:7]) == sorted(("PUT", f"/lfs-upload/{op['value']['oid']}") for op in ops
                                         if op["key"] == "lfsFile")
    assert writes[7:] == [("POST", "/api/models/someorg/tiny/commit/main"),
                          ("POST", f"/api/models/someorg/tiny/tag/{'c' * 40}")]
    assert "Bearer hf_test_token" in stub.auth
    cat = json.loads((p / "catalog.json").read_text())["models"]["tiny-zoo"]
    assert (cat["repo_id"], cat["revision"]) == ("someorg/tiny", "v1.0")
    assert "published someorg/tiny@v1.0" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")
def test_publish_refuses_changed_bundle_and_reports_tag_conflict(publish_pkg, hub_stub):
    p, exports = publish_pkg
    stub = hub_stub(fail_tag=True)
    with pytest.raises(hub.HubError, match="HTTP 409"):
        publish.publish("tiny-zoo", "someorg/tiny", exports_dir=exports, endpoint="http://hub.test")
    assert len(stub.tags) == 1
    (exports / "tiny-zoo" / "onnx" / "export.json").write_text(json.dumps({"format": "onnx",
                                                                          "checkpoint_sha256": "0" * 64}))
    with pytest.raises(hub.HubError, match="exported from other weights"):  # stale exports never ship
        publish.publish("tiny-zoo", "someorg/tiny", dry_run=True, exports_dir=exports)
    (p / "pretrained" / "tiny-zoo" / "vocab.json").write_text("[]")
    with pytest.raises(hub.IntegrityError, match="vocab.json"):
        publish.publish("tiny-zoo", "someorg/tiny", dry_run=True, exports_dir=exports)


# -- hf-hub: any compatible repo ----------------------------------------------------------------------------------
def test_hf_hub_repo_outside_the_catalogue_loads_unpinned(olah, env, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    model = zoo.load("hf-hub:someone/their-lm")
    assert model.source == "hub download (unpinned)" and not model.pinned and model.name == "their-lm"
    ref = zoo.load(Path(env["ZOO_CATALOG"]).parent / "pretrained" / "tiny-zoo")
    assert model.score("the market fell")[0]["ppl"] == ref.score("the market fell")[0]["ppl"]
    again = zoo.load("hf-hub:someone/their-lm")  # the second load needs no network
    assert again.source == "hub cache (unpinned)"
    code, out, _ = run_main(capsys, "info", "hf-hub:someone/their-lm", "--json")
    info = json.loads(out)
    assert code == 0 and info["pinned"] is False and info["source"] == "hub cache (unpinned)"
    commit = olah["commits"]["someone/their-lm"]
    assert zoo.load(f"hf-hub:someone/their-lm@{commit}").source.endswith("(unpinned)")


def test_hf_hub_name_of_a_catalogue_repo_keeps_its_sha256_pin(olah, env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    model = zoo.load("hf-hub:alstm-zoo/tiny-zoo")
    assert model.source == "hub download" and model.pinned and model.name == "tiny-zoo"
    with pytest.raises(hub.IntegrityError, match="sha256 mismatch"):  # the tampered repo is a catalogue entry
        zoo.load("hf-hub:alstm-zoo/tiny-tampered")


@pytest.mark.parametrize(("spec", "message"), [
    ("hf-hub:someone/not-a-zoo-model", "is not a zoo checkpoint"),
    ("hf-hub:someone/no-such-repo", "not found"),
    ("hf-hub:no-slash", "expected hf-hub:ORG/NAME"),
    ("hf-hub:a/b/c", "expected hf-hub:ORG/NAME"),
    ("hf-hub:someone/their-lm@", "expected hf-hub:ORG/NAME"),
])
def test_hf_hub_bad_specs_are_one_line_errors(olah, env, capsys, monkeypatch, spec, message):
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    code, _, err = run_main(capsys, "score", spec, "--text", "the market")
    # (a download shows huggingface_hub's progress bar on stderr before the error line)
    assert code == 2 and err.count("zoo: error:") == 1 and "Traceback" not in err, err
    assert message in err.rstrip().splitlines()[-1], err


def test_plain_install_without_bundled_copy_downloads_the_pinned_release(olah, env, monkeypatch):
    """No bundled copy (a wheel ships none) and no Hub opt-in: a catalogue name is fetched and verified."""
    monkeypatch.setenv("HF_ENDPOINT", olah["endpoint"])
    monkeypatch.delenv("ZOO_HUB", raising=False)
    from zoo import hub as hub_mod

    monkeypatch.setattr(hub_mod, "hub_requested", lambda: False)  # as if HF_ENDPOINT were the default Hub
    assert zoo.load("tiny-zoo").source == "hub download"


def test_a_release_cached_before_tokenizer_config_json_was_pinned_is_found_offline(tmp_path, monkeypatch):
    """A Hub snapshot of a release published (or cached) before every checkpoint carried ``tokenizer_config.json``:
    found in the cache with no network, verified, and given the file (derived from its vocabulary: the pinned
    bytes), so lm-eval's ``tokenizer=<folder>`` reads it."""
    from zoo.catalog import bundled_dir, release
    from zoo.checkpoint import TOKENIZER_CONFIG_FILE

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rel = release("alstm-ptb-5m")
    repo = tmp_path / "cache" / f"models--{rel.repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(bundled_dir() / rel.name, snap)
    (snap / TOKENIZER_CONFIG_FILE).unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / rel.revision).write_text("0" * 40)
    assert hub.find_in_cache(rel, tmp_path / "cache") == snap
    pinned = (bundled_dir() / rel.name / TOKENIZER_CONFIG_FILE).read_bytes()
    assert (snap / TOKENIZER_CONFIG_FILE).read_bytes() == pinned
