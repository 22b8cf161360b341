"""app.hub through huggingface_hub against tests/hub_stub.py's local server in the Hub's layout (no network): the
model search, a repo's files, a download paused and resumed with a Range request, an interrupted one continued, a
corrupted one refused, and the fit and first-model verdicts."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.hub import (KNOWN_REPOS, CorruptDownload, DownloadStopped, HubDownloader, RemoteFile, fits, fitting,
                     partial_bytes, reporting_bar, suggestion)
from tests.hub_stub import BIG, BIG_BYTES, HUGE, TINY, Listed, LocalHub

MiB = 2**20
INDEX = (Listed("someone/Qwen3.5-9B-GGUF", "qwen35", 900), Listed("other/Qwen3.6-35B-A3B-MTP-GGUF", "qwen35moe", 40),
         Listed("else/Qwen3.5-Llamafied-GGUF", "llama", 5000), Listed(KNOWN_REPOS[1][0], "qwen35", 7))


def test_search_lists_the_engines_architectures_known_mtp_builds_first() -> None:
    with LocalHub(INDEX) as hub:
        got = HubDownloader(hub.endpoint).search("")
        assert [r.repo for r in got] == [r for r, _, _ in KNOWN_REPOS] + ["other/Qwen3.6-35B-A3B-MTP-GGUF",
                                                                         "someone/Qwen3.5-9B-GGUF"]
        assert got[0].known and not got[-1].known and got[-1].about == "qwen35 · 900 downloads"
        assert [q["search"] for q in hub.searches] == [["Qwen3.5"], ["Qwen3.6"]]
        assert all(q["filter"] == ["gguf"] and "gguf" in q["expand"] for q in hub.searches)
        hub.searches.clear()
        assert [r.repo for r in HubDownloader(hub.endpoint).search("3.6")] == [
            KNOWN_REPOS[0][0], "other/Qwen3.6-35B-A3B-MTP-GGUF"]
        assert [q["search"] for q in hub.searches] == [["3.6"]]


def test_files_with_sizes() -> None:
    with LocalHub() as hub:
        assert HubDownloader(hub.endpoint).files("org/repo") == [
            RemoteFile(TINY, len(hub.data[TINY])), RemoteFile(BIG, BIG_BYTES), RemoteFile(HUGE, 5 * 2**40)]
        assert hub.listed == ["org/repo"]


def test_a_paused_download_resumes_with_a_range_request_and_is_checked(tmp_path: Path) -> None:
    with LocalHub() as hub:
        d = HubDownloader(hub.endpoint)
        stop, seen = threading.Event(), []

        def pause(done: int, total: int) -> None:
            seen.append((done, total))
            stop.set()

        with pytest.raises(DownloadStopped):
            d.download("org/repo", BIG, tmp_path, pause, stop)
        assert seen == [(10 * MiB, BIG_BYTES)] and partial_bytes(tmp_path, BIG) == 10 * MiB
        assert not (tmp_path / BIG).exists()
        stop.clear()
        seen.clear()
        got = d.download("org/repo", BIG, tmp_path, lambda *a: seen.append(a), stop)
        assert hub.ranges == [0, 10 * MiB] and seen == [(20 * MiB, BIG_BYTES), (BIG_BYTES, BIG_BYTES)]
        assert got == tmp_path / BIG and got.read_bytes() == hub.data[BIG] and partial_bytes(tmp_path, BIG) == 0


def test_an_interrupted_download_keeps_what_came_and_continues(tmp_path: Path) -> None:
    with LocalHub() as hub:
        d = HubDownloader(hub.endpoint)
        hub.cut_after(12 * MiB)  # the connection drops, then the server is down (huggingface_hub retries once)
        with pytest.raises(Exception, match="503"):
            d.download("org/repo", BIG, tmp_path, lambda *a: None, threading.Event())
        assert partial_bytes(tmp_path, BIG) == 10 * MiB  # whole chunks only
        hub.recover()
        got = d.download("org/repo", BIG, tmp_path, lambda *a: None, threading.Event())
        assert hub.ranges == [0, 10 * MiB] and got.read_bytes() == hub.data[BIG]


def test_a_corrupted_download_is_refused_and_removed(tmp_path: Path) -> None:
    with LocalHub() as hub:
        hub.corrupt = True
        with pytest.raises(CorruptDownload, match="SHA-256 is not the one Hugging Face records"):
            HubDownloader(hub.endpoint).download("org/repo", TINY, tmp_path, lambda *a: None, threading.Event())
        assert list(tmp_path.iterdir()) == []


def test_the_progress_bar_reports_and_stops() -> None:
    """huggingface_hub takes a progress-bar class: ours reports the bytes (from where a download starts) and stops
    it, before the chunk it is told of is written, once asked to."""
    seen: list[tuple[int, int]] = []
    stop = threading.Event()
    bar = reporting_bar(lambda d, t: seen.append((d, t)), stop)(unit="B", total=1000, initial=200, desc="x")
    bar.update(300)
    bar.update(100)
    stop.set()
    with pytest.raises(DownloadStopped):
        bar.update(100)
    assert seen == [(500, 1000), (600, 1000)]
    bar.close()


def test_fit_and_the_first_model() -> None:
    assert fits(MiB, 4096).startswith("fits this machine (about 0.5 GiB")  # 4,096 tokens of KV at most: 0.5 GiB
    assert fits(5 * 2**40, 4096).startswith("too large for this machine")
    assert fits(0, 4096) == "size not given"
    none = suggestion(10**9)  # nothing fits a billion tokens: the smallest, and it says so
    assert none.repo == KNOWN_REPOS[-1][0] and " · too large for this machine" in none.about
    largest = next((r for r, _, size in KNOWN_REPOS if fitting(size, 0)), KNOWN_REPOS[-1][0])
    assert suggestion(0).repo == largest and suggestion(0).known
