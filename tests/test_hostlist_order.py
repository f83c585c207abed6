"""Slurm host lists expanded without scontrol: the same hosts in the same order as ``scontrol show hostnames``.

Two independent references: a small re-statement of Slurm's documented expansion rule (its hostlist code treats the
last bracket group as the host's number suffix and expands the brackets before it, rightmost first, as prefixes),
and, where a Slurm client is installed, ``scontrol show hostnames`` itself on many generated lists.
"""

import random
import shutil
import subprocess

import pytest

from megatron_geo.parallel.launch_env import LaunchError, _expand_first_host, expand_hostlist


def _reference_values(body: str) -> list[str]:
    """``"1-3,07"`` -> 1 2 3 07: each value padded to the digit count of its range's lower bound."""
    values = []
    for item in body.split(","):
        lo, _, hi = item.partition("-")
        values += [f"{v:0{len(lo)}d}" for v in range(int(lo), int(hi or lo) + 1)]
    return values


def _reference_with_prefix(prefix: str, suffix_values: list[str]) -> list[str]:
    """Slurm's recursion: expand the rightmost bracket of ``prefix``; for each of its values (in order) either
    recurse on what is left or, when no bracket is left, append every suffix value."""
    open_at = prefix.rfind("[")
    if open_at < 0:
        return [prefix + v for v in suffix_values]
    close_at = prefix.index("]", open_at)
    before, body, after = prefix[:open_at], prefix[open_at + 1 : close_at], prefix[close_at + 1 :]
    out = []
    for value in _reference_values(body):
        out += _reference_with_prefix(before + value + after, suffix_values)
    return out


def reference_hostnames(nodelist: str) -> list[str]:
    """Hosts of a (valid) Slurm host list by Slurm's rule; comma-separated expressions, brackets never nested."""
    hosts, depth, token = [], 0, ""
    for ch in nodelist + ",":
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            if token:
                last = token.rfind("[")
                hosts += (
                    [token]
                    if last < 0
                    else _reference_with_prefix(token[:last], _reference_values(token[last + 1 : -1]))
                )
            token = ""
        else:
            token += ch
    return hosts


# Measured with `scontrol show hostnames` of Slurm 22.05 (the ground truth the reference must reproduce).
SCONTROL_22_05 = {
    "a[1-2]b[1-2]c[1-2]": "a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 a1b2c2 a2b2c1 a2b2c2",
    "x[1-2]y[1-2]z[1-2]w[1-2]": "x1y1z1w1 x1y1z1w2 x2y1z1w1 x2y1z1w2 x1y2z1w1 x1y2z1w2 x2y2z1w1 x2y2z1w2 "
    "x1y1z2w1 x1y1z2w2 x2y1z2w1 x2y1z2w2 x1y2z2w1 x1y2z2w2 x2y2z2w1 x2y2z2w2",
    "r[1-2]n[09-10]": "r1n09 r1n10 r2n09 r2n10",
    "n[1-2]-x[3]": "n1-x3 n2-x3",
    "gh[001-003,070],login1": "gh001 gh002 gh003 gh070 login1",
    "n[3,1,2]": "n3 n1 n2",
    "n[1-3,2]": "n1 n2 n3 n2",
    "n[9-010]": "n9 n10",
    "n[008-11]": "n008 n009 n010 n011",
    "a[1][2][3]": "a123",
    "[1-2]": "1 2",
    "a,,b": "a b",
}

# Refused by that scontrol ("Invalid hostlist"): text after the last bracket group, bad ranges, stray brackets.
SCONTROL_REFUSES = [
    "rack[1-2]-ib",
    "n[1-2]x",
    "a-[7]-b,c[2]",
    "ab[1-2]c[3-4]d",
    "n[3-1]",
    "n[-1]",
    "n[1-2,]",
    "n[,1]",
    "n[]",
    "n[1-a]",
    "n[0x1]",
    "n[[1-2]]",
    "n[1-2]]",
    "n[1-65537]",
]


def test_recorded_scontrol_order():
    for nodelist, hosts in SCONTROL_22_05.items():
        expected = hosts.split()
        assert reference_hostnames(nodelist) == expected, nodelist  # the reference states Slurm's rule
        assert expand_hostlist(nodelist) == expected, nodelist
        assert _expand_first_host(nodelist) == expected[0], nodelist  # MASTER_ADDR


def test_lists_slurm_refuses_are_refused():
    for nodelist in SCONTROL_REFUSES:
        with pytest.raises(LaunchError, match=r"cannot parse SLURM_JOB_NODELIST=.*set MASTER_ADDR"):
            expand_hostlist(nodelist)
        with pytest.raises(LaunchError):
            _expand_first_host(nodelist)


def _random_expression(rng: random.Random) -> str:
    groups = rng.randint(0, 4)
    name = rng.choice(["n", "gpu", "r", "a-", "x_"])
    for _ in range(groups):
        items = []
        for _ in range(rng.randint(1, 2)):
            width = rng.choice([1, 2, 3])
            lo = rng.randint(0, 12)
            item = f"{lo:0{width}d}"
            if rng.random() < 0.6:
                item += f"-{lo + rng.randint(0, 2)}"
            items.append(item)
        name += "[" + ",".join(items) + "]"
        if len(name) < 40 and rng.random() < 0.5:
            name += rng.choice(["b", "-", "ib", "s"])
    if groups and not name.endswith("]"):
        name += "[1]"  # Slurm needs the last bracket at the end
    return name


def _generated_lists(count: int, seed: int = 2205) -> list[str]:
    rng = random.Random(seed)
    return [",".join(_random_expression(rng) for _ in range(rng.randint(1, 3))) for _ in range(count)]


def test_generated_lists_follow_slurms_rule():
    lists = _generated_lists(400)
    assert sum(s.count("[") >= 3 for s in lists) > 50  # many lists with three or more groups
    for nodelist in lists:
        assert expand_hostlist(nodelist) == reference_hostnames(nodelist), nodelist


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """A runnable ``scontrol show hostnames`` (a minimal slurm.conf, no daemon needed), or skip."""
    exe = shutil.which("scontrol")
    if exe is None:
        pytest.skip("no Slurm client (scontrol) installed")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text(
        "ClusterName=hostlist\nSlurmctldHost=localhost\nAuthType=auth/none\nCredType=cred/none\n"
        "NodeName=localhost CPUs=1\nPartitionName=debug Nodes=ALL Default=YES\n"
    )
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(conf)}

    def show(nodelist: str) -> list[str] | None:
        r = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, env=env, timeout=30)
        if r.returncode != 0 or "Invalid hostlist" in r.stderr:
            return None
        return r.stdout.split()

    if show("n[1-2]") != ["n1", "n2"]:
        pytest.skip("scontrol show hostnames does not run here")
    return show


def test_generated_lists_match_scontrol(scontrol):
    for nodelist in _generated_lists(80, seed=7):
        assert expand_hostlist(nodelist) == scontrol(nodelist), nodelist


def test_refused_lists_are_refused_by_scontrol_too(scontrol):
    for nodelist in SCONTROL_REFUSES + ["rack[1-2]-ib,n1", "n1,m[1-2]x"]:
        assert scontrol(nodelist) is None, nodelist
        with pytest.raises(LaunchError):
            expand_hostlist(nodelist)
