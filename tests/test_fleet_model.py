"""bench/fleet_model.py's arithmetic on cases computed by hand.

The model is a benchmark script, and tests import nothing from bench/
(tests/test_structure.py), so each case runs it as a program: small fleets, every input
it uses set on the command line, inputs read from an empty directory, results written to
a temporary one and read back from its JSON. No servers; about a second in all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "fleet_model.py"

# One of every bound in sight, all round numbers (see test_the_binding_bound).
HAND = {
    "base_gets_trace": 10,  # once per node: 10 GETs, 1 MB
    "base_mb_trace": 1,
    "sympy_gets_trace": 30,  # the sympy task's own: 30 - 10 = 20 GETs, 101 - 1 = 100 MB
    "sympy_mb_trace": 101,
    "meta_gets": 5,  # per node and image: 20 + 5 = 25 GETs, 100 + 0 MB
    "meta_mb_sympy": 0,
    "hot_pack_share": 0.5,
    "sympy_cold_trace_s": 2.5,  # one cold start: 2.5 - 1 = 1.5 s
    "sympy_warm_s": 1,
    "burst_sandboxes": 100,  # a node: 100 / (2 - 1) = 100 sandboxes/s, 1 / 10 = 0.1 s a tree
    "burst_images": 10,
    "burst_generic_s": 2,
    "burst_tree_s": 1,
    "measured_cores": 2,
    "cores": 2,
    "prefix_gets_per_s": 100,
    "store_gbit": 8,  # 1 GB/s
    "link_gbit": 8,
    "eps": 0.25,
}


def run_model(tmp_path: Path, *args: str, sets: dict[str, float] | None = None) -> dict:
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--results", str(tmp_path / "none"), "--out", str(out)]
    argv += ["--no-plot", *args]
    for name, value in (sets or {}).items():
        argv += ["--set", f"{name}={value}"]
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60)
    return json.loads((out / "fleet_model.json").read_text())


def placement(res: dict, name: str) -> dict:
    return next(p for p in res["placements"] if p["placement"] == name)


def row(res: dict, workload: str, placement: str, trace: bool) -> dict:
    return next(
        o
        for o in res["outcomes"]
        if (o["workload"], o["placement"], o["trace"]) == (workload, placement, trace)
    )


def test_random_placement_is_the_balls_in_bins_expectation(tmp_path: Path) -> None:
    # 10 images of 3 sandboxes on 4 nodes: an image misses a node with (3/4)^3 = 27/64,
    # so it lands on 4 * 37/64 = 2.3125 nodes, and the 10 on 23.125.
    res = run_model(tmp_path, "--sandboxes", "30", "--images", "10", "--nodes", "4")
    assert placement(res, "random")["pairs"] == pytest.approx(23.125)
    # 25 sandboxes: 5 images of 3 (2.3125 each) and 5 of 2 (4 * (1 - 9/16) = 1.75 each).
    res = run_model(tmp_path, "--sandboxes", "25", "--images", "10", "--nodes", "4")
    assert placement(res, "random")["pairs"] == pytest.approx(5 * 2.3125 + 5 * 1.75)


def test_cache_placement_starts_each_image_once_when_nodes_have_room(tmp_path: Path) -> None:
    # A slack so wide that no node is ever full: every image stays on its first node.
    res = run_model(
        tmp_path, "--sandboxes", "200", "--images", "20", "--nodes", "8", sets={"eps": 1000}
    )
    cache = placement(res, "cache")
    assert cache["pairs"] == 20
    assert cache["max_load"] == 10 * cache["max_images"]
    # The bounded load holds: no node above ceil(1.5 x the mean) = ceil(1.5 * 25) = 38
    # (1 + 2 eps where the image is warm: lazyfs/gateway/placement.py).
    res = run_model(tmp_path, "--sandboxes", "200", "--images", "20", "--nodes", "8")
    cache = placement(res, "cache")
    assert cache["max_load"] <= 38
    assert 20 <= cache["pairs"] < placement(res, "random")["pairs"]


def test_the_binding_bound(tmp_path: Path) -> None:
    """One node, 10 images of 10 sandboxes: both placements put all on it (10 cold
    starts, A = 1, L = 100, C = 10). The sympy task with traces, by hand:
    GETs 1 * 10 + 10 * 25 = 260; one partition 260 / 100 = 2.6 s; hottest key
    1 * 10 * 0.5 / 100 = 0.05 s; bytes 1 + 10 * 100 = 1,001 MB, so the store and the node
    link both 1.001 s; node creates 100 / 100 + 10 * 0.1 = 2.0 s; one cold start 1.5 s."""
    res = run_model(tmp_path, "--sandboxes", "100", "--images", "10", "--nodes", "1", sets=HAND)
    for name in ("cache", "random"):
        o = row(res, "sympy task", name, True)
        assert o["pairs"] == pytest.approx(10)
        assert o["gets"] == pytest.approx(260)
        assert o["bytes"] == pytest.approx(1_001e6)
        assert o["bounds"] == pytest.approx(
            {
                "S3 GET rate, one partition": 2.6,
                "S3 GET rate, hottest key": 0.05,
                "store bandwidth": 1.001,
                "node link": 1.001,
                "node creates": 2.0,
                "one cold start": 1.5,
            }
        )
        assert o["binds"] == {
            "partitioned bucket": "node creates",
            "fresh bucket": "S3 GET rate, one partition",
        }
        assert o["t"] == pytest.approx({"partitioned bucket": 2.0, "fresh bucket": 2.6})


def test_cores_scale_the_node_bound(tmp_path: Path) -> None:
    # Twice the cores: 100 / 200 + 10 * 0.05 = 1.0 s, and the cold start (1.5 s) binds.
    res = run_model(
        tmp_path,
        *("--sandboxes", "100", "--images", "10", "--nodes", "1"),
        sets={**HAND, "cores": 4},
    )
    o = row(res, "sympy task", "cache", True)
    assert o["bounds"]["node creates"] == pytest.approx(1.0)
    assert o["binds"]["partitioned bucket"] == "one cold start"


def test_a_fleet_benchmark_is_fitted_and_checked(tmp_path: Path) -> None:
    """G = A g_b + P g_p in both runs: 4 nodes, cache P = 8, random P = 20, with
    g_b = 10 and g_p = 5 (80 and 140 GETs), b_b = 4 MB and b_p = 1 MB (24 and 36 MB)."""

    def run(placement: str, images: list[int], gets: int, mb: int) -> dict:
        return {
            "placement": placement,
            "trace": True,
            "wall_s": 5.0,
            "create_p50_s": 1.0,
            "create_p99_s": 2.0,
            "store_gets": gets,
            "store_bytes": mb * 1_000_000,
            "node_sandboxes": [50, 50, 50, 50],
            "node_images": images,
            "node_cache_bytes": [0, 0, 0, 0],
        }

    doc = {
        "nodes": 4,
        "cores": 2,
        "images": 50,
        "sandboxes": 200,
        "link": "1 Gbit/s tbf + 4 ms",
        "runs": [run("cache", [2, 2, 2, 2], 80, 24), run("random", [5, 5, 5, 5], 140, 36)],
    }
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(doc))
    res = run_model(tmp_path, "--nodes", "10", "--images", "10", "--sandboxes", "100",
                    "--fleet-results", str(fleet))  # fmt: skip
    fitted = next(w for w in res["workloads"] if w["name"] == "fleet bench")
    assert fitted["base"] == pytest.approx({"gets": 10, "bytes": 4e6})
    assert fitted["pair"] == pytest.approx({"gets": 5, "bytes": 1e6})
    checked = {r["placement"]: r for r in res["fleet_check"]}
    assert checked["cache"]["pairs_measured"] == 8
    assert checked["random"]["pairs_measured"] == 20
    assert checked["random"]["wall_measured"] == 5.0
