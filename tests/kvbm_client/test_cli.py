"""`kvbm serve`'s supervisor (which daemons it starts, with which arguments) and the help
text of every subcommand."""
import re

import pytest

from kvbm_client.cli import Supervisor, build_parser
from kvbm_client.config import OPTIONS, KvbmConfig, Option


def argv_tail(child) -> list[str]:
    return child.argv[2:]  # drop the interpreter and "-m"


def test_cpu_workers_by_default() -> None:
    sup = Supervisor(KvbmConfig(cpu_cache_gb=1), 2, {}, False)
    assert argv_tail(sup.leader) == ["kvbm_leader", "--num-workers", "2"]
    assert [argv_tail(w) for w in sup.workers] == [["kvbm_worker", "--worker-id", "0", "--cpu"],
                                                   ["kvbm_worker", "--worker-id", "1", "--cpu"]]


def test_one_gpu_worker_per_device() -> None:
    sup = Supervisor(KvbmConfig(cpu_cache_gb=1), 1, {}, True, gpus=[2, 3])
    assert argv_tail(sup.leader) == ["kvbm_leader", "--num-workers", "2"]
    assert [argv_tail(w) for w in sup.workers] == [["kvbm_worker", "--worker-id", "0", "--gpu", "2"],
                                                   ["kvbm_worker", "--worker-id", "1", "--gpu", "3"]]
    assert sup.env["DYN_LOG"] == "debug"


def test_serve_rejects_bad_gpu_list(capsys) -> None:
    args = build_parser().parse_args(["serve", "--gpus", "zero", "--cpu-cache-gb", "1"])
    assert args.func(args) == 2
    assert "--gpus wants comma-separated device ordinals" in capsys.readouterr().err


def test_a_staging_area_reaches_every_worker() -> None:
    sup = Supervisor(KvbmConfig(cpu_cache_gb=1), 1, {}, False, gpus=[0, 1], worker_args=["--stage-mib", "1024"])
    assert [argv_tail(w) for w in sup.workers] == [
        ["kvbm_worker", "--worker-id", "0", "--gpu", "0", "--stage-mib", "1024"],
        ["kvbm_worker", "--worker-id", "1", "--gpu", "1", "--stage-mib", "1024"]]


def test_serve_refuses_a_staging_area_out_of_bounds(capsys) -> None:
    args = build_parser().parse_args(["serve", "--stage-mib", "1e9", "--cpu-cache-gb", "1"])
    assert args.func(args) == 2
    assert "--stage-mib must be in [0, 65536], got 1e+09" in capsys.readouterr().err


def test_serve_without_a_tier_explains(capsys, monkeypatch) -> None:
    for var in ("DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_DISK_CACHE_GB", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
                "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["serve"])
    assert args.func(args) == 2
    assert "no cache tier configured" in capsys.readouterr().err


def flag(opt: Option) -> str:
    return "--" + opt.field.replace("_", "-")


def help_of(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal: one layout to parse
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def explained(help_text: str) -> tuple[set[str], dict[str, str]]:
    """What an argparse help offers (the flags and subcommands of its usage) and, for each
    entry of its body, the text that explains it (continuation lines joined)."""
    usage, body = help_text.split("\n\n", 1)
    offered = set(re.findall(r"\[(--[\w-]+)", usage))
    for choices in re.findall(r"\{([\w,-]+)\}", usage):
        offered.update(choices.split(","))
    entries: dict[str, str] = {}
    key = None
    for line in body.splitlines():
        if key is not None and line.startswith(" " * 6):
            entries[key] += " " + line.strip()
            continue
        match = re.match(r"^ {2,4}(\S+(?:,? \S+)*?)(?: {2,}(\S.*))?$", line)
        key = None
        if match:
            words = match.group(1).replace(",", " ").split()
            key = next((w for w in reversed(words) if w.startswith("--")), words[0])
            entries[key] = match.group(2) or ""
    return offered, entries


@pytest.mark.parametrize("argv, expected", [
    (["--help"], {"serve", "status", "doctor"}),
    (["serve", "--help"], {"--workers", "--gpus", "--stage-mib", "--debug", *(flag(o) for o in OPTIONS)}),
    (["status", "--help"], {"--leader", "--json", "--socket-dir", "--leader-address"}),
])
def test_help_explains_every_subcommand_and_option(argv, expected, capsys, monkeypatch) -> None:
    offered, entries = explained(help_of(argv, capsys, monkeypatch))
    assert offered == expected
    for name in offered:
        assert len(entries.get(name, "").split()) >= 3, f"kvbm {' '.join(argv)}: {name} is not explained"
    for opt in OPTIONS:
        if flag(opt) in offered:
            assert opt.env in entries[flag(opt)], f"{flag(opt)}'s help does not name {opt.env}"


def test_help_text_parser_sees_what_is_missing() -> None:
    """The check above can fail: an option without help, or offered but not listed, is caught."""
    text = ("usage: kvbm serve [-h] [--workers WORKERS] [--quiet]\n\noptions:\n"
            "  -h, --help         show this help message and exit\n  --workers WORKERS  CPU worker\n"
            "                     daemons to start\n  --quiet\n")
    offered, entries = explained(text)
    assert offered == {"--workers", "--quiet"}
    assert entries["--workers"] == "CPU worker daemons to start"
    assert entries["--quiet"] == ""
