"""A 20-second soak (benchmarks/soak.py) on the embedded model: 16 streaming clients with disconnects,
aborts and bad requests mixed in. Every quiet moment the KV pages come back to 0, and nothing is a 5xx.
A quiet moment every 5 s: 4 of them here (3 during the traffic, 1 after), where 30 s with one every 10 s had 3;
20 s still gives ~150 streams that ran to the end (> 50) and each of disconnects, aborts and bad requests.
(The 30-minute run on the standard model, with the RSS and latency checks, is `python benchmarks/soak.py`.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_soak_twenty_seconds():
    soak = _soak_module()
    srv = ServerProcess("--max-num-seqs", "16")
    try:
        args = soak.parse_args(["--duration", "20", "--clients", "16", "--quiet-every", "5", "--window", "10"])
        card = srv.get(f"/v1/models/{srv.model}").json()
        result = soak.run_soak(srv.url, srv.model, soak._vocab(srv.url), card["max_model_len"], args, srv.proc.pid)
    finally:
        code = srv.stop()
    statuses = result["statuses"]
    assert result["verdict"]["pages_back_to_zero"], result["quiet_moments"]
    assert result["verdict"]["no_5xx"], statuses
    assert len(result["quiet_moments"]) >= 3
    assert statuses.get("200", 0) > 50 and statuses.get("400", 0) > 0, statuses
    assert statuses.get("disconnect", 0) > 0 and statuses.get("abort", 0) > 0, statuses
    assert "transport" not in statuses, statuses  # the server never dropped a connection on its own
    assert code == 0, srv.logs()[-3000:]
    assert "Traceback" not in srv.logs()
