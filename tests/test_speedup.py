"""What may be said of a reply's speed: a ratio only against measured MTP-off replies of the same engine and model,
long enough to time; a word for no drafts, too short, or a server's own setting."""
from __future__ import annotations

from app.speedup import MIN_TOKENS, SERVER, Reply, baseline, verdict

LOCAL, REMOTE = "m · this computer", "m · remote vllm server"


def test_verdicts() -> None:
    off = Reply(40.0, "off", 64, None, LOCAL)
    off2 = Reply(50.0, "off", MIN_TOKENS, None, LOCAL)
    short_off = Reply(99.0, "off", MIN_TOKENS - 1, None, LOCAL)
    fast = Reply(90.0, "K=3", 200, 120, LOCAL)
    assert verdict(fast, [fast]).label == "" and "no MTP-off reply yet" in verdict(fast, [fast]).sentence
    assert baseline([short_off, Reply(10.0, "off", 500, None, REMOTE)], LOCAL) is None
    v = verdict(fast, [off, off2, short_off, fast])
    assert v.ratio == 2.0 and v.label == "×2.0" and "the average of 2 MTP-off replies of this model" in v.sentence
    assert verdict(Reply(90.0, "auto", 200, 0, LOCAL), [off]).label == "no drafts"
    assert verdict(Reply(90.0, "auto", 200, None, LOCAL), [off]).label == "no drafts"
    assert verdict(Reply(90.0, "auto", MIN_TOKENS - 1, 20, LOCAL), [off]).label == "short"
    server = Reply(175.7, SERVER, 300, 100, REMOTE)
    assert verdict(server, [off, server]).ratio is None and server.kind == SERVER
    remote_auto = Reply(175.7, "auto", 300, 100, REMOTE)  # a server that takes MTP per request (Foretell)
    assert "no MTP-off reply yet" in verdict(remote_auto, [off, remote_auto]).sentence
    assert verdict(remote_auto, [off, Reply(100.0, "off", 300, None, REMOTE)]).label == "×1.8"
