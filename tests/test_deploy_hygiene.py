"""Deployment hygiene, without starting Flower: credentials land outside the working tree by
default (or where git ignores them) with private keys 0600; the SuperLink binds loopback unless
told otherwise, and warns then; the proxy script checks its arguments and renders a config that
passes nothing but the Fleet API. The scripts run with a stand-in ``flower-superlink``
(FLWR_BIN_DIR) that prints its arguments.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from deploy_support import needs_openssl

from simulations.flower.deploy import DEPLOY, REPO

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def script(name: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(cwd)}
    return subprocess.run(["bash", str(DEPLOY / name), *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**base, **(env or {})})


def git_repo(path: Path) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q", str(path)], check=True, timeout=30)
    return path


PRIVATE = ("ca.key", "server.key", "supernode-0")


@needs_openssl
def test_make_certs_writes_outside_the_working_tree_by_default(tmp_path):
    res = script("make_certs.sh", "-s", "10.0.0.5", "-n", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / ".config" / "celgc" / "certs"  # HOME/.config: XDG_CONFIG_HOME unset
    assert sorted(p.name for p in out.iterdir()) == sorted(["ca.crt", "server.crt", "supernode-0.pub", *PRIVATE])
    for key in PRIVATE:
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600, key
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    res = script("make_certs.sh", "-s", "x", cwd=tmp_path, env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert res.returncode == 0 and (tmp_path / "xdg" / "celgc" / "certs" / "ca.key").is_file()


@needs_openssl
@needs_git
def test_make_certs_refuses_a_folder_git_would_commit(tmp_path):
    repo = git_repo(tmp_path / "repo")
    for target in ("certs", "sub/deeper/certs", "."):
        res = script("make_certs.sh", "-o", target, "-s", "x", cwd=repo)
        assert res.returncode == 2, (target, res.stderr)
        assert f"make_certs.sh: {target} is inside the git working tree {repo} and not ignored" in res.stderr
    assert sorted(p.name for p in repo.iterdir()) == [".git"]  # nothing was written
    (repo / ".gitignore").write_text("/certs/\n")
    res = script("make_certs.sh", "-o", "certs", "-s", "x", cwd=repo)
    assert res.returncode == 0, res.stderr
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                            timeout=30, check=True).stdout
    assert status.split() == ["??", ".gitignore"]  # the keys are invisible to git
    assert all(stat.S_IMODE((repo / "certs" / k).stat().st_mode) == 0o600 for k in ("ca.key", "server.key"))


@needs_git
def test_this_repository_ignores_certs():
    res = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "certs/ca.key"], timeout=30)
    if res.returncode == 128:
        pytest.skip("not a git checkout")
    assert res.returncode == 0


def fake_superlink(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "flower-superlink"
    fake.write_text('#!/bin/sh\necho "flower-superlink $*"\n')
    fake.chmod(0o755)
    return {"FLWR_BIN_DIR": str(bin_dir), "FLWR_HOME": str(tmp_path / "home")}


@needs_openssl
def test_the_superlink_binds_loopback_by_default_and_warns_otherwise(tmp_path):
    env = fake_superlink(tmp_path)
    assert script("make_certs.sh", "-o", "certs", "-s", "x", cwd=tmp_path).returncode == 0
    res = script("start_superlink.sh", "--certs", "certs", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert "--host 127.0.0.1 --port 9093" in res.stdout and "--enable-supernode-auth" in res.stdout
    assert "WARNING" not in res.stderr
    res = script("start_superlink.sh", "--certs", "certs", "--host", "0.0.0.0", cwd=tmp_path, env=env)
    assert res.returncode == 0 and "--host 0.0.0.0" in res.stdout
    assert "the Control API (register SuperNodes, submit runs" in res.stderr and "0.0.0.0:9093" in res.stderr


def test_start_proxy_checks_its_arguments(tmp_path):
    res = script("start_proxy.sh", cwd=tmp_path)
    assert res.returncode == 2 and "--certs DIR is required" in res.stderr
    res = script("start_proxy.sh", "--certs", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2 and "ca.crt is missing: run make_certs.sh" in res.stderr
    for name in ("ca.crt", "server.crt", "server.key"):
        (tmp_path / name).write_text("")
    for flag, value, message in [("--listen", "9092", "--listen must be ADDR:PORT, got 9092"),
                                 ("--upstream", "host", "--upstream must be HOST:PORT, got host"),
                                 ("--max-body", "lots", "--max-body must be a size like 64m, got lots"),
                                 ("--run-dir", str(tmp_path / "a b"), "path must not contain spaces")]:
        res = script("start_proxy.sh", "--certs", str(tmp_path), flag, value, cwd=tmp_path)
        assert res.returncode == 2 and message in res.stderr, (flag, res.stderr)


@needs_openssl
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)")
def test_the_rendered_proxy_config_passes_only_the_fleet_api(tmp_path):
    assert script("make_certs.sh", "-o", "certs", "-s", "x", cwd=tmp_path).returncode == 0
    res = script("start_proxy.sh", "--certs", "certs", "--listen", "127.0.0.1:19092", "--upstream",
                 "10.0.0.7:9093", "--run-dir", "run", "--check", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "is not a loopback address" in res.stderr  # an upstream reachable from elsewhere warns
    conf = (tmp_path / "run" / "nginx.conf").read_text()
    assert "@" not in conf  # every placeholder filled in
    locations = [line.strip() for line in conf.splitlines() if line.strip().startswith("location")]
    assert locations == ["location ~ ^/v1/fleet/[a-z-]+$ {", "location / {"]
    assert conf.count("proxy_pass") == 1 and "server 10.0.0.7:9093;" in conf
