"""The README's configuration table lists every option the daemons accept, with its default."""
from pathlib import Path

from kvbm_client.config import OPTIONS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_option_is_documented_with_its_default() -> None:
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
            for line in README.read_text().splitlines() if line.startswith("| `")}
    for opt in OPTIONS:
        assert opt.env in rows, f"{opt.env} missing from the README's configuration table"
        default = "unset" if opt.default is None else str(opt.default).lower() \
            if isinstance(opt.default, bool) else str(opt.default)
        assert rows[opt.env] == default, f"{opt.env}: README says {rows[opt.env]}, code says {default}"
