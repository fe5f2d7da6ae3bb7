#!/usr/bin/env python3
"""Build the swe-mini task images offline, serve them from a real local registry, write the dataset.

Each task is a SWE-style image: a minimal Debian root made from Debian's own packages by
``mmdebstrap`` (python3, python3-pytest, git), and on top of it a real open-source pure-Python
project, downloaded as a pinned sdist from the package index, unpacked at ``/testbed`` as a git
repository whose one commit carries a planted one-line bug. The image's config sets
``WorkingDir=/testbed`` and ``Env``; the grader runs the project's own test file and names the
tests the bug breaks (``fail_to_pass``) and some it must leave passing (``pass_to_pass``).

    python examples/swe-mini/build.py                        # images + layouts + archives, no registry
    python examples/swe-mini/build.py --registry             # also push to a local registry (stopped at exit)
    python examples/swe-mini/build.py --registry --serve     # ... and keep it serving until Ctrl-C

Outputs under ``--out`` (default ``runs/swe-mini``): ``oci/`` (one OCI image layout, a tag per
task), ``archives/NAME.tar`` (``docker save`` archives) and ``dataset.jsonl`` (rows naming the
images through the transport chosen by ``--transport``).

Tools, all Debian packages (``scripts/system-deps test`` installs them): ``mmdebstrap`` makes the
root; ``umoci`` builds the OCI layout; ``skopeo`` copies it to the registry and to the archive
format; ``docker-registry`` is the registry. Why umoci to *build* and skopeo to *copy*: skopeo
cannot make an image, only move one between transports (it speaks every one we need: ``oci:``,
``docker-archive:``, ``docker://``), while umoci edits OCI layouts in place without a daemon or
root — ``raw add-layer`` appends a tar verbatim as a layer (mmdebstrap writes exactly such a
tar, with no ``/dev`` nodes, which rollcage's unpacker refuses) and ``config`` sets
``WorkingDir``/``Env``. ``podman``/``buildah`` could do both, but need container storage and
(for a Dockerfile) a runtime; ``docker`` needs a daemon.

Everything slow is cached under ``--cache`` (default ``$XDG_CACHE_HOME/rollcage/swe-mini``) by a
content key (the inputs that make it, hashed): the Debian root tar (the package set, the suite,
the mirror), each sdist (verified against its pinned sha256), and the built layout and archives
(the base key, every task's definition, this recipe's version). A second run with the same
inputs only copies (hard links) and pushes.

Only the standard library and subprocess: this runs before rollcage is installed, and with any
Python 3.11+.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RECIPE = "swe-mini/1"
"""Bump when the way images are made changes (it is part of every content key)."""

SUITE = "bookworm"
MIRROR = os.environ.get("SWE_MINI_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("python3", "python3-pytest", "git")
IMAGE_ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONDONTWRITEBYTECODE=1",
)
REPO = "swe-mini"
"""Repository prefix of the images in the registry and in archives: ``swe-mini/NAME:TAG``."""
JUNIT = "/testbed/.swe-mini-junit.xml"
"""Where the grader's pytest writes its JUnit XML: inside /testbed, not /tmp, which a sandbox may
mount as a fresh tmpfs that the grader could not read back."""
EPOCH = 1_700_000_000
"""The commit date and every mtime of /testbed: the same inputs give the same layer."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One SWE-style task: a project at a pinned version, a one-line bug, the tests that see it."""

    name: str
    project: str
    version: str
    sha256: str
    """Of the sdist; a download that does not match is refused."""
    path: str
    """File (relative to the project root) that gets the bug."""
    good: str
    """The line as released (exactly once in the file)."""
    bad: str
    """The line with the bug."""
    test_file: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    issue: str
    """The prompt: what a user would report."""

    @property
    def tag(self) -> str:
        return self.version

    def test_command(self) -> str:
        """The grader's command: the project's own test file, JUnit XML written where the grader reads it."""
        return f"python3 -m pytest -p no:cacheprovider -q --junitxml={JUNIT} {self.test_file}"

    def key(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TASKS: tuple[Task, ...] = (
    Task(
        name="inflection",
        project="inflection",
        version="0.5.1",
        sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
        path="inflection/__init__.py",
        good="        return string[0].lower() + camelize(string)[1:]",
        bad="        return string[0] + camelize(string)[1:]",
        test_file="test_inflection.py",
        fail_to_pass=("test_inflection.py::test_camelize_with_lower_downcases_the_first_letter",),
        pass_to_pass=(
            "test_inflection.py::test_camelize_with_underscores",
            "test_inflection.py::test_pluralize_plurals",
            "test_inflection.py::test_uncountable_word_is_not_greedy",
        ),
        issue=(
            "inflection.camelize('Capital', False) returns 'Capital', but with "
            "uppercase_first_letter=False the first letter should be lower case ('capital'). "
            "Fix it in the repository at /testbed without breaking other behaviour."
        ),
    ),
    Task(
        name="toolz",
        project="toolz",
        version="1.0.0",
        sha256="2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02",
        path="toolz/itertoolz.py",
        good="        d[item] += 1",
        bad="        d[item] = 1",
        test_file="toolz/tests/test_itertoolz.py",
        fail_to_pass=("toolz/tests/test_itertoolz.py::test_frequencies",),
        pass_to_pass=(
            "toolz/tests/test_itertoolz.py::test_groupby",
            "toolz/tests/test_itertoolz.py::test_unique",
            "toolz/tests/test_itertoolz.py::test_first",
        ),
        issue=(
            "toolz.frequencies(['cat', 'pig', 'cat']) returns {'cat': 1, 'pig': 1}: every count is 1. "
            "It should count occurrences ({'cat': 2, 'pig': 1}). Fix it in the repository at /testbed."
        ),
    ),
    Task(
        name="more-itertools",
        project="more-itertools",
        version="10.5.0",
        sha256="5482bfef7849c25dc3c6dd53a6173ae4795da2a41a80faea6700d9f5846c5da6",
        path="more_itertools/more.py",
        good="    return sum(compress(repeat(1), zip(iterable)))",
        bad="    return sum(compress(repeat(1), iterable))",
        test_file="tests/test_more.py",
        fail_to_pass=("tests/test_more.py::IlenTests::test_ilen",),
        pass_to_pass=(
            "tests/test_more.py::ChunkedTests::test_even",
            "tests/test_more.py::FirstTests::test_many",
            "tests/test_more.py::LastTests::test_basic",
        ),
        issue=(
            "more_itertools.ilen([0, 0, 1]) returns 1 instead of 3: items that are false (0, '', None) "
            "are not counted. Fix ilen in the repository at /testbed."
        ),
    ),
)


class BuildError(Exception):
    """A step of the build failed; the message says which and what it printed."""


class MirrorUnreachable(BuildError):
    """mmdebstrap could not reach the Debian mirror (no network here): nothing to build from."""


# --------------------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"swe-mini: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], *, what: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run a tool; a failure is a BuildError with the tool's last words."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[-3000:]
        raise BuildError(f"{what} failed (exit status {done.returncode}): {said}")
    return done.stdout


def need(*programs: str) -> None:
    missing = [p for p in programs if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        raise BuildError(
            f"{', '.join(missing)} not found: install with 'apt-get install -y {' '.join(missing)}' "
            "(or scripts/system-deps test)"
        )


def content_key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def default_cache() -> Path:
    explicit = os.environ.get("SWE_MINI_CACHE")
    if explicit:
        return Path(explicit).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollcage" / "swe-mini"


def mirror_reachable(timeout_s: float = 15.0) -> bool:
    """Whether the Debian mirror answers (its Release file), within ``timeout_s``."""
    url = f"{MIRROR.rstrip('/')}/dists/{SUITE}/Release"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
            return True
    except (urllib.error.URLError, OSError):
        return False


def link_tree(src: Path, dest: Path) -> None:
    """``dest`` as a copy of ``src`` whose files are hard links (content-addressed blobs never change),
    except ``index.json``, which umoci rewrites, copied."""

    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:  # another file system (a tmpfs /tmp): copy
            shutil.copy2(source, target)

    shutil.copytree(src, dest, copy_function=link_or_copy)
    for index in dest.rglob("index.json"):
        data = index.read_bytes()
        index.unlink()
        index.write_bytes(data)


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A temporary sibling of ``final`` renamed to it when the block succeeds (whole or absent)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final) if final.is_dir() else final.unlink()
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the Debian root


def base_key() -> str:
    return content_key(RECIPE, SUITE, MIRROR, PACKAGES, _mmdebstrap_options())


def _mmdebstrap_options() -> list[str]:
    return [
        # essential: only Essential:yes packages and what --include pulls in (no apt: the image never
        # installs anything); --skip=output/dev: no device nodes in the tar (an image must not carry
        # any; rollcage refuses them); docs, man pages and locales left out to keep the layer small.
        "--variant=essential",
        f"--include={','.join(PACKAGES)}",
        "--skip=output/dev",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        # /testbed belongs to root in the image while the agent runs as the sandbox's uid: git must
        # not call it dubious.
        "--customize-hook=printf '[safe]\\n\\tdirectory = *\\n' > \"$1/etc/gitconfig\"",
    ]


def ensure_base(cache: Path) -> Path:
    """The Debian root as a tar (mmdebstrap), cached by its content key."""
    final = cache / "base" / f"{base_key()}.tar"
    if final.is_file():
        return final
    need("mmdebstrap")
    log(f"making the Debian {SUITE} root with mmdebstrap ({', '.join(PACKAGES)}), about 1-2 minutes")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{os.getpid()}.{final.name}")
    argv = ["mmdebstrap", "--quiet", "--format=tar", *_mmdebstrap_options(), SUITE, str(tmp), MIRROR]
    try:
        run(argv, what="mmdebstrap")
    except BuildError as exc:
        tmp.unlink(missing_ok=True)
        if not mirror_reachable():
            raise MirrorUnreachable(f"the Debian mirror {MIRROR} cannot be reached: {exc}") from exc
        raise
    os.rename(tmp, final)
    return final


# --------------------------------------------------------------------------- the projects


def ensure_sdist(cache: Path, task: Task) -> Path:
    """The task's sdist from the package index, verified against its pinned sha256."""
    directory = cache / "sdist" / f"{task.project}-{task.version}-{task.sha256[:12]}"
    found = sorted(directory.glob("*.tar.gz")) if directory.is_dir() else []
    if found and _sha256(found[0]) == task.sha256:
        return found[0]
    log(f"downloading the {task.project} {task.version} sdist from the package index")
    with staging(directory) as tmp:
        # --no-binary for this project only: the sdist (sources and tests), while its build backend,
        # which pip needs to read the sdist's metadata, may come as a wheel.
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                task.project,
                "--dest",
                str(tmp),
                f"{task.project}=={task.version}",
            ],
            what=f"pip download {task.project}=={task.version}",
        )
        files = sorted(tmp.glob("*.tar.gz"))
        if len(files) != 1:
            raise BuildError(f"pip download {task.project}=={task.version} gave {files}, not one sdist")
        got = _sha256(files[0])
        if got != task.sha256:
            raise BuildError(f"{files[0].name}: sha256 {got}, pinned {task.sha256}; refusing it")
    return directory / files[0].name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def testbed_layer(task: Task, sdist: Path, dest: Path) -> Path:
    """A layer tar holding ``testbed/``: the sdist unpacked, the bug planted, one git commit."""
    with tempfile.TemporaryDirectory(prefix="swe-mini-") as scratch:
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
        (top,) = list(unpacked.iterdir())
        testbed = Path(scratch) / "testbed"
        shutil.move(top, testbed)
        for junk in [*testbed.rglob("__pycache__"), *testbed.rglob("*.pyc")]:
            if junk.exists():
                shutil.rmtree(junk) if junk.is_dir() else junk.unlink()
        plant_bug(testbed, task)
        _commit(testbed, task)
        _write_layer(testbed, dest)
    return dest


def plant_bug(testbed: Path, task: Task) -> None:
    """Replace ``task.good`` by ``task.bad`` in ``task.path`` (it must occur exactly once)."""
    path = testbed / task.path
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line == task.good]
    if len(hits) != 1:
        raise BuildError(f"{task.name}: the line to break occurs {len(hits)} times in {task.path}, not once")
    lines[hits[0]] = task.bad
    path.write_text("\n".join(lines), encoding="utf-8")


def _commit(testbed: Path, task: Task) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "swe-mini",
        "GIT_AUTHOR_EMAIL": "swe-mini@rollcage.invalid",
        "GIT_COMMITTER_NAME": "swe-mini",
        "GIT_COMMITTER_EMAIL": "swe-mini@rollcage.invalid",
        "GIT_AUTHOR_DATE": f"@{EPOCH} +0000",
        "GIT_COMMITTER_DATE": f"@{EPOCH} +0000",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    git = ["git", "-c", "init.defaultBranch=main", "-c", "core.autocrlf=false"]
    run([*git, "init", "--quiet"], what="git init", cwd=testbed, env=env)
    run([*git, "add", "--all"], what="git add", cwd=testbed, env=env)
    message = f"{task.project} {task.version}"
    run([*git, "commit", "--quiet", "--no-gpg-sign", "-m", message], what="git commit", cwd=testbed, env=env)
    # What the agent's and the grader's runs leave behind is not part of the change.
    exclude = testbed / ".git" / "info" / "exclude"
    exclude.parent.mkdir(exist_ok=True)
    exclude.write_text(f"__pycache__/\n*.pyc\n.pytest_cache/\n{Path(JUNIT).name}\n")


def _write_layer(testbed: Path, dest: Path) -> None:
    """The tar of ``testbed/``: sorted, owned by root, fixed mtimes, so the same inputs give the same bytes.

    Directories are 0777 and files 0666 (0777 if executable): the agent runs as the sandbox's uid, not
    the image's root, and must be able to edit the repository (git records only the executable bit).
    """
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as archive:
        paths = [testbed, *sorted(testbed.rglob("*"))]
        for path in paths:
            name = "testbed" if path == testbed else f"testbed/{path.relative_to(testbed).as_posix()}"
            info = tarfile.TarInfo(name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = EPOCH
            if path.is_symlink():
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                info.mode = 0o777
                archive.addfile(info)
            elif path.is_dir():
                info.type = tarfile.DIRTYPE
                info.mode = 0o777
                archive.addfile(info)
            else:
                data = path.read_bytes()
                info.size = len(data)
                info.mode = 0o777 if os.access(path, os.X_OK) else 0o666
                archive.addfile(info, io.BytesIO(data))


# --------------------------------------------------------------------------- the images


@dataclasses.dataclass(frozen=True)
class Built:
    """What a build produced."""

    layout: Path
    """The OCI image layout, one tag per task (``Task.name``)."""
    archives: dict[str, Path]
    """Task name -> its ``docker save`` archive."""
    key: str
    """The content key of the images."""

    def oci_ref(self, task: Task) -> str:
        return f"oci:{self.layout}:{task.name}"

    def archive_ref(self, task: Task) -> str:
        return f"docker-archive:{self.archives[task.name]}"


def images_key(tasks: tuple[Task, ...] = TASKS) -> str:
    return content_key(RECIPE, base_key(), IMAGE_ENV, JUNIT, EPOCH, [t.key() for t in tasks])


def ensure_images(cache: Path, tasks: tuple[Task, ...] = TASKS) -> Built:
    """Every task's image as an OCI layout and as docker archives, cached by content key."""
    key = images_key(tasks)
    final = cache / "images" / key
    with _locked(cache / "build.lock"):  # two builds at once (test workers) do the work once
        if not (final / "done").exists():
            _build_images(cache, tasks, final, key)
            for stale in final.parent.iterdir():  # earlier recipes' images (~700 MB each); exports keep links
                if stale != final and not stale.name.startswith("."):
                    shutil.rmtree(stale, ignore_errors=True)
    return Built(final / "oci", {t.name: final / "archives" / f"{t.name}.tar" for t in tasks}, key)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build_images(cache: Path, tasks: tuple[Task, ...], final: Path, key: str) -> None:
    need("umoci", "skopeo")
    base = ensure_base(cache)
    sdists = {task.name: ensure_sdist(cache, task) for task in tasks}
    with staging(final) as tmp:
        layout = tmp / "oci"
        _base_layout(base, layout)
        for task in tasks:
            log(f"adding {task.name}'s /testbed layer")
            layer = testbed_layer(task, sdists[task.name], tmp / f"{task.name}.layer.tar")
            add = ["umoci", "raw", "add-layer", "--image", f"{layout}:base", "--tag", task.name]
            run([*add, str(layer)], what=f"umoci raw add-layer ({task.name})")
            run(
                [
                    "umoci",
                    "config",
                    "--image",
                    f"{layout}:{task.name}",
                    "--config.workingdir=/testbed",
                    f"--config.label=org.opencontainers.image.title={task.project} {task.version}",
                    "--history.created_by=swe-mini: /testbed",
                ],
                what="umoci config",
            )
            layer.unlink()
        run(["umoci", "gc", "--layout", str(layout)], what="umoci gc")
        archives = tmp / "archives"
        archives.mkdir()
        for task in tasks:
            log(f"writing {task.name}'s docker archive (skopeo)")
            skopeo_copy(
                f"oci:{layout}:{task.name}",
                f"docker-archive:{archives / f'{task.name}.tar'}:{REPO}/{task.name}:{task.tag}",
            )
        (tmp / "done").write_text(key + "\n")


def _base_layout(base_tar: Path, layout: Path) -> None:
    """The Debian root as the ``base`` tag of a new OCI layout (umoci compresses the layer)."""
    log("packing the Debian root into an OCI layout (umoci)")
    run(["umoci", "init", "--layout", str(layout)], what="umoci init")
    run(["umoci", "new", "--image", f"{layout}:base"], what="umoci new")
    run(
        [
            "umoci",
            "raw",
            "add-layer",
            "--image",
            f"{layout}:base",
            "--history.created_by=mmdebstrap --variant=essential " + ",".join(PACKAGES),
            str(base_tar),
        ],
        what="umoci raw add-layer (the Debian root)",
    )
    run(
        [
            "umoci",
            "config",
            "--image",
            f"{layout}:base",
            *(f"--config.env={e}" for e in IMAGE_ENV),
            "--config.cmd=/bin/bash",
            "--no-history",
        ],
        what="umoci config (base)",
    )


def skopeo_copy(src: str, dest: str, *, insecure: bool = False) -> None:
    """``skopeo copy`` without a signature policy file (none is needed to copy our own images)."""
    argv = ["skopeo", "--insecure-policy", "copy", "--quiet"]
    if insecure:
        argv.append("--dest-tls-verify=false")
    run([*argv, src, dest], what=f"skopeo copy {src} {dest}")


def export(built: Built, out: Path) -> Built:
    """The built images under ``out`` (hard links into the cache): ``oci/`` and ``archives/``."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("oci", "archives"):
        if (out / name).exists():
            shutil.rmtree(out / name)
    link_tree(built.layout, out / "oci")
    link_tree(built.layout.parent / "archives", out / "archives")
    return Built(out / "oci", {k: out / "archives" / v.name for k, v in built.archives.items()}, built.key)


# --------------------------------------------------------------------------- the registry


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalRegistry:
    """Debian's ``docker-registry`` on a free loopback port, its storage in ``directory``.

    Use as a context manager (stopped at the end, also on failure), or call :meth:`stop`.
    """

    def __init__(self, directory: Path) -> None:
        need("docker-registry")
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log = directory / "registry.log"
        config = directory / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: info\n"
            f"storage:\n  filesystem:\n    rootdirectory: {directory / 'data'}\n"
            f"http:\n  addr: {self.host}\n"
        )
        binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            [binary, "serve", str(config)], stdout=self._log_file, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready(60.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = self.log.read_text(errors="replace")[-2000:]
                raise BuildError(f"docker-registry did not start on {self.host}: {said}")
            time.sleep(0.05)  # polling a server's readiness: nothing to wait on but its port

    def push(self, built: Built, task: Task) -> str:
        """Copy a task's image into the registry; returns its ``docker://`` reference."""
        ref = f"docker://{self.host}/{REPO}/{task.name}:{task.tag}"
        skopeo_copy(built.oci_ref(task), ref, insecure=True)
        return ref

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> LocalRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- the dataset


INSTRUCTIONS = (
    "You are a software engineer fixing a bug in the git repository at /testbed (your working "
    "directory). Use the bash tool to explore and run the tests, and the editor to change files. "
    "When the fix is done, answer with a one-line summary."
)


def dataset_row(task: Task, image: str) -> dict[str, Any]:
    """The dataset row of one task, its image named by ``image`` (any rollcage image reference)."""
    return {
        "id": task.name,
        "input": task.issue,
        "instructions": INSTRUCTIONS,
        "tools": ["bash", "str_replace_based_edit_tool"],
        "sandbox": {"image": image},
        "agent": {"max_policy_calls": 8},
        "model": {"max_retries": 0},
        "grader": {
            "type": "tests",
            "command": task.test_command(),
            "junit_xml": JUNIT,
            "fail_to_pass": list(task.fail_to_pass),
            "pass_to_pass": list(task.pass_to_pass),
            "timeout_s": 600,
        },
        "metadata": {"project": task.project, "version": task.version, "file": task.path},
    }


def write_dataset(path: Path, refs: dict[str, str], tasks: tuple[Task, ...] = TASKS) -> Path:
    """``dataset.jsonl``: one row per task, ``refs`` mapping task name -> image reference."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataset_row(t, refs[t.name])) + "\n" for t in tasks))
    return path


def refs_for(built: Built, transport: str, registry: LocalRegistry | None) -> dict[str, str]:
    """Each task's image reference through ``transport`` (docker: pushed to ``registry`` first)."""
    refs = {}
    for task in TASKS:
        if transport == "docker":
            if registry is None:
                raise BuildError("--transport docker needs --registry")
            log(f"pushing {task.name} to {registry.host} (skopeo)")
            refs[task.name] = registry.push(built, task)
        elif transport == "oci":
            refs[task.name] = built.oci_ref(task)
        else:
            refs[task.name] = built.archive_ref(task)
    return refs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/swe-mini"), help="output directory")
    parser.add_argument("--cache", type=Path, default=None, help="build cache (default: user cache)")
    parser.add_argument("--registry", action="store_true", help="start a local registry and push")
    parser.add_argument("--serve", action="store_true", help="with --registry: serve until Ctrl-C")
    parser.add_argument(
        "--transport",
        choices=("docker", "oci", "docker-archive"),
        default=None,
        help="how the dataset names the images (default: docker with --registry, else oci)",
    )
    args = parser.parse_args(argv)
    transport = args.transport or ("docker" if args.registry else "oci")
    out = args.out.absolute()
    try:
        built = export(ensure_images((args.cache or default_cache()).absolute()), out)
        with contextlib.ExitStack() as stack:
            registry = stack.enter_context(LocalRegistry(out / "registry")) if args.registry else None
            refs = refs_for(built, transport, registry)
            dataset = write_dataset(out / "dataset.jsonl", refs)
            for name, ref in refs.items():
                print(f"{name}\t{ref}")
            print(f"dataset: {dataset}")
            if registry is not None and args.serve:
                log(f"registry serving on {registry.host}; Ctrl-C stops it")
                with contextlib.suppress(KeyboardInterrupt):
                    registry.proc.wait()
    except BuildError as exc:
        print(f"swe-mini: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
