"""Whether MTP made a reply faster, said only where it was measured (no Qt here; the Metrics tab draws it).

A reply's speed is compared only with replies decoded without MTP by the same engine and model (a remote
server is never compared with this computer), each long enough to time (MIN_TOKENS): the comparison is a
measurement, never an estimate. A reply that drafted nothing, one too short to time, and one whose server chose
its own MTP setting get a word instead of a ratio.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import mean
from typing import Sequence

MIN_TOKENS = 32  # fewer generated tokens are timed too roughly to compare (start-up and the first step dominate)
SERVER = "server"  # the mode of a reply from a remote server that chooses MTP and its depth itself
SHORT = "short"  # the label of a reply too short to compare


@dataclass(frozen=True)
class Reply:
    tok_s: float
    mode: str  # "off", "auto", "K=n" (we chose), or SERVER
    tokens: int  # generated
    drafted: int | None  # tokens drafted; None where no figures came (MTP off, a server that reports none)
    engine: str  # which engine and model made it (app.session.ModelInfo.engine)

    @property
    def kind(self) -> str:
        """The colour group: "off", "auto", "fixed" or "server"."""
        return self.mode if self.mode in ("off", "auto", SERVER) else "fixed"


@dataclass(frozen=True)
class Baseline:
    tok_s: float
    replies: int  # the MTP-off replies it is the average of


@dataclass(frozen=True)
class Verdict:
    label: str  # on the reply's bar
    sentence: str  # in the summary and the bar's tooltip
    ratio: float | None  # the reply's speed over the baseline's, where compared


def mode_name(mode: str) -> str:
    return "the server's MTP" if mode == SERVER else f"MTP {mode}"


def baseline(replies: Sequence[Reply], engine: str) -> Baseline | None:
    """The average speed of `engine`'s measured MTP-off replies long enough to compare; None before there is one."""
    off = [r.tok_s for r in replies if r.engine == engine and r.kind == "off" and r.tokens >= MIN_TOKENS]
    return Baseline(mean(off), len(off)) if off else None


def verdict(r: Reply, replies: Sequence[Reply]) -> Verdict:
    """What may be said of reply `r`'s speed among `replies` (those of every engine)."""
    if r.kind == SERVER:
        return Verdict("", "MTP and its depth are the server's own setting: there is no MTP-off reply of it to "
                           "compare with", None)
    if r.tokens < MIN_TOKENS:
        return Verdict(SHORT, f"{r.tokens} tokens: too short to compare (under {MIN_TOKENS})", None)
    if r.kind == "off":
        return Verdict("", "MTP off: the baseline other replies of this model are compared with", None)
    if not r.drafted:
        return Verdict("no drafts", f"{mode_name(r.mode)} drafted nothing: decoded as without MTP", None)
    base = baseline(replies, r.engine)
    if base is None:
        return Verdict("", "no MTP-off reply yet to compare with (turn MTP off in Settings for one reply of "
                           f"{MIN_TOKENS}+ tokens)", None)
    ratio = r.tok_s / base.tok_s
    many = f"the average of {base.replies} MTP-off replies" if base.replies > 1 else "one MTP-off reply"
    return Verdict(f"×{ratio:.1f}", f"×{ratio:.1f} vs MTP off ({r.tok_s:.1f} against {base.tok_s:.1f} tokens/s, "
                                    f"{many} of this model)", ratio)
