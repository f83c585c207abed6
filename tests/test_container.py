"""What can be checked of the container without a Docker engine: the Dockerfile's base image and COPY
sources, that its install command is the one the README documents, and what that command installs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for ln in joined.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_base_image_is_a_multiarch_ngc_pytorch_image():
    ins = _instructions()
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    m = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", args["BASE_IMAGE"])
    assert m, args["BASE_IMAGE"]
    assert (int(m.group(1)), int(m.group(2))) >= (25, 10), "PyTorch >= 2.9 (torch.optim.Muon) needs NGC 25.10+"
    assert ("FROM", "${BASE_IMAGE}") in ins
    assert any(w == "ENV" and "WANDB_MODE=${WANDB_MODE}" in a for w, a in ins)


def test_every_copied_path_exists_and_is_not_ignored():
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip()}
    copies = [a.split()[:-1] for w, a in _instructions() if w == "COPY"]
    assert copies
    for srcs in copies:
        for src in srcs:
            assert not src.startswith("--"), "no COPY --from/--chown expected"
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
            assert src not in ignored, f"{src} is excluded by .dockerignore"
    copied = {s for srcs in copies for s in srcs}
    # what the install step and the entry points need
    assert {"pyproject.toml", "README.md", "megatron_geo", "scripts", "pretrain_llama.py", "configs"} <= copied


def test_install_command_is_the_one_the_readme_documents():
    runs = [a for w, a in _instructions() if w == "RUN"]
    install = [r for r in runs if "container_install.sh" in r]
    assert len(install) == 1, runs
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Run on a cluster") :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    assert install[0] in section, f"README's 'Run on a cluster' section must show `{install[0]}`"
    # the install step runs before the code that is not needed for it is copied (layer caching)
    order = [w + " " + a for w, a in _instructions()]
    assert order.index("RUN " + install[0]) < order.index("COPY configs ./configs")


def test_container_install_keeps_torch_and_installs_the_rest():
    r = subprocess.run(
        ["bash", "scripts/container_install.sh", "--print", "eval"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    reqs = r.stdout.split()
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = [d for d in proj["dependencies"] + proj["optional-dependencies"]["eval"] if not d.startswith("torch")]
    assert reqs == list(dict.fromkeys(expected))
    assert not any(x.lower().startswith(("torch", "transformer")) for x in reqs)
    bad = subprocess.run(
        ["bash", "scripts/container_install.sh", "--print", "gpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert bad.returncode != 0 and "unknown extra 'gpu'" in bad.stderr
