"""The alert automation against a real Prefect server on PostgreSQL, as a lasting server with
automations should run: a pretrain run that fails sends one notification to a webhook (a local
receiver here), naming the run and the stage that failed."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.fixtures_gpt import ROOT
from tests.run_folder import wait_until

pytestmark = pytest.mark.integration  # starts servers of its own


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server interface
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook():
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", _Receiver.received
    server.shutdown()


@pytest.mark.timeout(600)
def test_a_failed_run_sends_one_notification_naming_the_run_and_the_failed_stage(prefect_server_on_postgres, webhook, tmp_path):
    prefect_server = prefect_server_on_postgres
    url, received = webhook
    env = {**prefect_server.env, "PYTHONPATH": str(ROOT)}
    made = subprocess.run([sys.executable, "-m", "deployments.setup", "--webhook"], env={**env, "GPT_ALERT_WEBHOOK_URL": url},
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    assert prefect_server.api("/work_pools/gpt")["type"] == "process"      # the same command made the work pool
    assert url not in made.stdout + made.stderr            # the URL is a secret: never printed
    blocks = prefect_server.api("/block_documents/filter", {})
    assert any(b["name"] == "gpt-pretrain-alerts" for b in blocks) and url not in json.dumps(blocks)   # nor shown
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"this is not gzip data, whatever its name says\n" * 100)
    run = subprocess.run([sys.executable, "-m", "flows.pretrain", "--source", str(bad), "--root", str(tmp_path / "root"),
                          "--run-name", "doomed", "--train-iters", "2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    (flow_run,) = [r for r in prefect_server.api("/flow_runs/filter", {"flow_runs": {}})
                   if (r["parameters"].get("output") or {}).get("run_name") == "doomed"]
    assert flow_run["state"]["type"] == "FAILED" and flow_run["state"]["message"].startswith("stage tokenize failed:")
    wait_until(lambda: received, 240, "the notification", every=1)   # the server's automations may lag under load
    time.sleep(5)
    # One notification for the run. Prefect delivers an automation's action at least once: a busy server
    # (its SQLite store locked) may send the same message again, never one about another state or run.
    assert {(n["subject"], n["text"]) for n in received} == {(received[0]["subject"], received[0]["text"])}
    note = received[0]
    assert flow_run["name"] in note["subject"] and "Failed" in note["subject"]
    assert "stage tokenize failed" in note["text"] and "bad.jsonl.gz" in note["text"]
