"""A bounded fuzz of the command line: bad values for every option of every command, generated, each one
`error: …` line and exit 2, never an "internal error" or a traceback.

A pool of argument strings (numbers at and past each option's range, NaN and infinities, empty and long
strings, undecodable argv bytes, units, origins, seeded random ones) is given to each option in turn; an oracle
written from the options' documented ranges (`--help`, engine.validate) picks the bad ones. Valid ones are not
run (they would load and generate); the oracle is checked to find both kinds for every option. `serve` cases
name a port this test holds, so a bad value let through could never start serving.
"""
from __future__ import annotations

import math
import random
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from engine import cli, validate
from tests.fixtures import TINY_MOE, fixture_path

Oracle = Callable[[str], bool]  # is this argument valid?
SURROGATE = "caf\udce9"  # what argv holds for bytes that are not UTF-8


def as_int(v: str) -> int | None:
    try:
        return int(v)
    except ValueError:
        return None


def as_float(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


def utf8(v: str) -> bool:
    return re.search("[\ud800-\udfff]", v) is None


@dataclass(frozen=True)
class Int:
    lo: int
    hi: int

    def __call__(self, v: str) -> bool:
        n = as_int(v)
        return n is not None and self.lo <= n <= self.hi

    def edges(self) -> list[str]:
        return [str(n) for n in (self.lo - 1, self.lo, self.hi, self.hi + 1, self.hi * 10 + 7, -(self.hi + 1))]


@dataclass(frozen=True)
class Num:
    lo: float
    hi: float
    lo_open: bool = False
    tiny_ok: bool = True  # a value in (0, MIN_LOGIT_DIVISOR): refused for a temperature

    def __call__(self, v: str) -> bool:
        x = as_float(v)
        if x is None or not math.isfinite(x) or x > self.hi or x < self.lo or (self.lo_open and x == self.lo):
            return False
        return self.tiny_ok or not 0 < x < validate.MIN_LOGIT_DIVISOR

    def edges(self) -> list[str]:
        return [repr(x) for x in (self.lo, self.hi, self.lo - 1e-9, self.hi + 1e-9, self.hi * 1e6, -self.hi)]


def one_of(*words: str) -> Oracle:
    return lambda v: v in words


def draft(v: str) -> bool:
    return v == "auto" or (v.isascii() and v.isdigit() and 1 <= (as_int(v) or 0) <= validate.MAX_DRAFT)


def device(v: str) -> bool:
    return re.fullmatch(r"cpu|cuda(:\d{1,3})?", v) is not None


def gpu_layers_on_cpu(v: str) -> bool:
    return v == "auto" or as_int(v) == 0  # the base device is the CPU: no layer can go to a GPU


def expert_cache(v: str) -> bool:
    return v.strip().lower() == "auto" or re.fullmatch(r"\d{1,12}(MiB|GiB|M|G)?", v.replace(" ", ""), re.I) is not None


def stop(v: str) -> bool:
    return utf8(v) and 1 <= len(v) <= validate.MAX_STOP_CHARS


def api_key(v: str) -> bool:
    return 1 <= len(v) <= validate.MAX_API_KEY_CHARS and all("!" <= c <= "~" for c in v)


def origin(v: str) -> bool:
    return re.fullmatch(r"[a-z][a-z0-9+.-]*://[^\s/?#]+", v) is not None


def token_ids(v: str) -> bool:
    parts = [t for t in v.replace(" ", "").split(",") if t]
    return bool(parts) and all(as_int(t) is not None and 0 <= int(t) < TINY_MOE.n_vocab for t in parts)


DEVICE_OPTIONS: dict[str, Oracle] = {
    "--device": device, "--threads": Int(1, validate.MAX_THREADS), "--gpu-layers": gpu_layers_on_cpu,
    "--expert-cache": expert_cache, "--miss-policy": one_of("load", "cpu"),
}
COMMANDS: dict[str, dict[str, Oracle]] = {
    "generate": {
        "--max-tokens": Int(1, validate.MAX_TOKENS), "--temp": Num(0, 100, tiny_ok=False),
        "--top-k": Int(0, validate.MAX_TOP_K), "--top-p": Num(0, 1, lo_open=True), "--min-p": Num(0, 1),
        "--repeat-penalty": Num(validate.MIN_LOGIT_DIVISOR, 100), "--seed": Int(0, validate.MAX_SEED),
        "--stop": stop, "--ctx": Int(1, validate.MAX_CTX), "--draft": draft, "--prompt": utf8,
        "--prompt-tokens": token_ids, **DEVICE_OPTIONS,
    },
    "serve": {
        "--port": Int(0, validate.MAX_PORT), "--queue": Int(0, validate.MAX_QUEUE), "--api-key": api_key,
        "--cors": origin, "--ctx": Int(1, validate.MAX_CTX), "--draft": draft,
        "--max-tokens": Int(1, validate.MAX_TOKENS), "--temp": Num(0, 100, tiny_ok=False), **DEVICE_OPTIONS,
    },
    "inspect": {"--ctx": Int(1, validate.MAX_CTX), **DEVICE_OPTIONS},
    "logits": {"--tokens": token_ids, **DEVICE_OPTIONS},
}


def pool(seed: int = 48) -> list[str]:
    words = ["", " ", "0", "1", "2", "8", "9", "-1", "-0", "+3", " 5 ", "1_000", "٣", "1.5", "1e3", "1e-300",
             "1e400", "-1e400", "nan", "NaN", "inf", "-inf", "0x10", "abc", "auto", "AUTO", "none", "cpu", "cuda",
             "cuda:0", "cuda:x",
             "load", "64", "512MiB", "2 GiB", "1TiB", "lots", "1,2,3", "1,,2", "1,x", "99999", str(2 ** 31),
             str(2 ** 64), str(10 ** 30), "9" * 5000, "x" * 257, "x" * 100_000, SURROGATE, "two words", "clé",
             "*", "http://localhost:3000", "http://localhost:3000/", "null", "--help"]
    rng = random.Random(seed)
    words += [str(rng.randint(-(2 ** 70), 2 ** 70)) for _ in range(4)]
    words += [repr(rng.uniform(-1e9, 1e9)) for _ in range(2)]
    words += ["".join(chr(rng.randint(33, 0x2FFF)) for _ in range(rng.randint(1, 12))) for _ in range(4)]
    return words


def base_args(command: str, option: str, busy_port: int, out: Path) -> list[str]:
    """A valid command line for `command`, to which `option=value` is added."""
    model = str(fixture_path(TINY_MOE))
    return {
        "generate": ["generate", model, "--max-tokens", "2", "--json"]
                    + ([] if option == "--prompt-tokens" else ["--prompt", "hi"]),  # the two exclude each other
        "serve": ["serve", model, "--port", str(busy_port)],  # held: a value let through fails to bind, never serves
        "inspect": ["inspect", model, "--json"],
        "logits": ["logits", model, "--tokens", "1,2", "--out", str(out)],
    }[command]


def values(valid: Oracle) -> list[str]:
    return pool() + (valid.edges() if isinstance(valid, (Int, Num)) else [])


def cases(busy_port: int, out: Path) -> Iterator[tuple[list[str], str, str]]:
    for command, options in COMMANDS.items():
        for option, valid in options.items():
            bad = [v for v in values(valid) if not valid(v)]
            assert bad and len(bad) < len(values(valid)), (command, option)  # the oracle finds both kinds
            for v in bad:
                yield base_args(command, option, busy_port, out) + [f"{option}={v}"], command, option


def run(capsys, args: list[str]) -> tuple[int, str]:
    try:
        rc = cli.main(args)
    except SystemExit as e:  # argparse's own complaint
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.err


def assert_one_line(rc: int, err: str, want: tuple[int, ...], case: object) -> None:
    lines = err.strip().splitlines()
    assert rc in want, (case, rc, err[:300])
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, err[:300])
    assert "internal error" not in err and "Traceback" not in err, (case, err[:300])
    assert len(err) < 1000, (case, err[:300])  # a value is quoted cut short, whatever its length


def test_bad_option_values_are_one_line_and_exit_2(capsys, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        n = 0
        for args, command, option in cases(held.getsockname()[1], tmp_path / "o.npy"):
            rc, err = run(capsys, args)
            assert_one_line(rc, err, (2,), (command, option, args[-1][:60]))
            n += 1
    assert n > 1000
    assert not (tmp_path / "o.npy").exists()  # no bad value got as far as a pass


def test_bad_files_are_one_line(capsys, tmp_path: Path) -> None:
    """Paths the world refuses: exit 1, or 2 for a text file over the size limit."""
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.truncate(validate.MAX_TEXT_FILE_BYTES + 1)
    model = str(fixture_path(TINY_MOE))
    for path, want in [(tmp_path / "missing.txt", 1), (tmp_path, 1), (tmp_path / "latin1.txt", 1), (big, 2),
                       (Path("/dev/zero"), 2)]:
        assert_one_line(*run(capsys, ["tokenize", model, "--text-file", str(path)]), (want,), path)
    for path in (tmp_path / "missing.gguf", tmp_path, tmp_path / "latin1.txt", Path("/dev/null"), big):
        assert_one_line(*run(capsys, ["inspect", str(path)]), (1,), path)
    for out in (tmp_path / "no" / "such" / "o.npy", tmp_path, Path("")):
        assert_one_line(*run(capsys, ["logits", model, "--tokens", "1,2", "--out", str(out)]), (2,), out)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_valid_values_of_the_pool_are_still_taken(command: str) -> None:
    """The oracle's valid values parse: what the fuzz calls bad is bad, not all that it tried."""
    parser = cli.build_parser()
    for option, valid in COMMANDS[command].items():
        for v in values(valid):
            if valid(v):
                parser.parse_args(base_args(command, option, 8080, Path("o.npy")) + [f"{option}={v}"])
