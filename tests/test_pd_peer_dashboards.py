"""The operators' dashboard (docs/grafana/pd-peers.json) and alert rules
(docs/prometheus/pd-peer-alerts.yml) of the per-peer PD series.

promtool accepts the rules, and each rule fires on its case and not on a healthy
peer (``promtool test rules``); the dashboard and the rules name only series the
patch writes (``PD_PEER_METRICS``), and every one of them somewhere; and a real
Prometheus, scraping series written by the real ``_PeerMetrics`` through
prometheus_client's multiprocess collector (as sglang's /metrics reads them),
finds the held-at-share rule's prefill and only it.

The exporter here serves the text format whatever the scraper asks for: Prometheus
2.42 (Debian 12's) asks for OpenMetrics 1.0.0 without an ``escaping`` parameter,
and prometheus_client 0.26 then writes every sample name with ``_`` for ``:``
(``sglang_pd_prefill_state``, under ``# TYPE sglang:pd_prefill_state``), so such
a Prometheus stores none of sglang's ``sglang:`` series under their names.

Needs Debian's ``prometheus`` package (promtool and prometheus), which
``python3 dev.py test`` installs; elsewhere than Debian, the tests that run them
are skipped.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "pd-peers.json"
RULES = REPO / "docs" / "prometheus" / "pd-peer-alerts.yml"
METRIC = re.compile(r"sglang:[a-z_:]+")
DEADLINE_S = 60.0


@functools.cache
def peer_metrics():
    """(PD_PEER_METRICS, _PeerMetrics) of the patched sglang (a slow import)."""
    from sglang.srt.disaggregation.common.conn import PD_PEER_METRICS, _PeerMetrics

    return PD_PEER_METRICS, _PeerMetrics


def exported_names() -> set[str]:
    """The sample names /metrics shows: counters with ``_total``."""
    registry, _ = peer_metrics()
    return {
        f"{name}_total" if typ == "counter" else name
        for name, (typ, _) in registry.items()
    }


def load_rules() -> list[dict]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    assert group["name"] == "sglang-pd-peers", group["name"]
    return group["rules"]


def rule_expr(alert: str) -> str:
    (rule,) = [r for r in load_rules() if r["alert"] == alert]
    return rule["expr"]


def dashboard_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))  # collapsed rows


def panel_exprs(dashboard: dict) -> list[str]:
    return [
        target["expr"]
        for panel in dashboard_panels(dashboard["panels"])
        for target in panel.get("targets", [])
    ]


def variable_exprs(dashboard: dict) -> list[str]:
    queries = [
        v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    return [q["query"] if isinstance(q, dict) else q for q in queries]


def tool(test: unittest.TestCase, name: str) -> str:
    path = shutil.which(name)
    if path is None:
        install = "apt-get install --no-install-recommends prometheus"
        if Path("/etc/debian_version").exists():
            test.fail(f"{name} is not on PATH: run `{install}` (dev.py test does)")
        test.skipTest(f"{name} is not on PATH, and this is not Debian ({install})")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DashboardAndRulesTest(unittest.TestCase):
    def test_promtool_accepts_the_rules(self):
        proc = subprocess.run(
            [tool(self, "promtool"), "check", "rules", str(RULES)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        for rule in load_rules():
            with self.subTest(rule=rule["alert"]):
                self.assertIn("for", rule)
                self.assertIn(rule["labels"]["severity"], {"warning", "critical"})
                self.assertTrue(rule["annotations"]["summary"].strip())
                self.assertTrue(rule["annotations"]["description"].strip())

    def test_they_name_exactly_the_series_the_patch_writes(self):
        """Only series the patch writes; each on a panel or in a rule (a query
        variable does not count: it shows no value)."""
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = {
            "panel": panel_exprs(dashboard),
            "rule": [rule["expr"] for rule in load_rules()],
            "variable": variable_exprs(dashboard),
        }
        known, used = exported_names(), set()
        for where, texts in exprs.items():
            for text in texts:
                names = set(METRIC.findall(text))
                self.assertTrue(names, f"{where}: no sglang series in {text!r}")
                self.assertLessEqual(names, known, f"{where}: unknown in {text!r}")
                if where != "variable":
                    used |= names
        self.assertEqual(known - used, set(), "series with no panel and no rule")

    def test_the_dashboard_is_importable(self):
        dashboard = json.loads(DASHBOARD.read_text())
        self.assertIsNone(dashboard["id"])
        variables = {var["name"]: var for var in dashboard["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        panels = list(dashboard_panels(dashboard["panels"]))
        self.assertEqual(len({p["id"] for p in panels}), len(panels), "panel ids")
        for panel in panels:
            with self.subTest(panel=panel["title"]):
                pos = panel["gridPos"]
                self.assertLessEqual(pos["x"] + pos["w"], 24)
                if panel["type"] != "row":
                    self.assertEqual(panel["datasource"]["uid"], "${datasource}")
                    self.assertTrue(panel["targets"])
        (state,) = [p for p in panels if "sglang:pd_prefill_state{" in str(p)]
        (mapping,) = state["fieldConfig"]["defaults"]["mappings"]
        self.assertEqual(sorted(mapping["options"]), ["0", "1", "2", "3"])

    def test_each_rule_fires_on_its_case_only(self):
        """``promtool test rules`` over 10 minutes of 15 s samples: each alert
        fires for its peer (its ``for`` is met by then), none for the healthy
        ones."""
        decode = {"instance": "decode:30000", "job": "sglang", "tp_rank": "0"}
        prefill = {"instance": "prefill:30000", "job": "sglang", "tp_rank": "0"}

        def at(name: str, **labels) -> dict:
            return {**decode, "prefill": f"{name}:8998", **labels}

        def to(name: str, **labels) -> dict:
            return {**prefill, "decode": f"{name}:17000", **labels}

        failures, rooms_failed = (
            "sglang:pd_prefill_failures_total",
            "sglang:pd_decode_rooms_failed_total",
        )
        series = [
            ("sglang:pd_prefill_state", at("ok"), "0x40"),
            ("sglang:pd_prefill_waiting_reqs", at("ok"), "1x40"),
            ("sglang:pd_prefill_seconds_since_transfer", at("ok"), "1x40"),
            ("sglang:pd_prefill_fenced_tokens", at("ok"), "0x40"),
            ("sglang:pd_prefill_state", at("stuck"), "0x20 2x20"),
            # Failed at 5 min, gone a minute later with its series.
            ("sglang:pd_prefill_state", at("dead"), "0x20 3x4"),
            (failures, at("dead", kind="heartbeat"), "_x21 1+1x3"),
            ("sglang:pd_prefill_state", at("flaky"), "1x40"),
            (failures, at("flaky", kind="heartbeat"), "1+1x40"),
            (failures, at("ok", kind="timeout"), "1x40"),
            ("sglang:pd_prefill_fenced_tokens", at("fenced"), "0x10 512x30"),
            ("sglang:pd_prefill_waiting_reqs", at("quiet"), "2x40"),
            ("sglang:pd_prefill_seconds_since_transfer", at("quiet"), "0+15x40"),
            ("sglang:pd_decode_oldest_chunk_age_seconds", to("ok"), "1x40"),
            ("sglang:pd_decode_oldest_chunk_age_seconds", to("stuck"), "0+15x40"),
            (rooms_failed, to("ok", kind="session"), "1x40"),
            (rooms_failed, to("bad", kind="transfer"), "0+1x40"),
        ]
        firing = {
            "PDPrefillHeldAtShare": [at("stuck")],
            "PDPrefillFailed": [at("dead"), at("flaky")],
            "PDPrefillFencedKV": [at("fenced")],
            "PDPrefillNoTransfer": [at("quiet")],
            "PDDecodeChunkStuck": [to("stuck")],
            "PDDecodeRoomsFailing": [to("bad", kind="transfer")],
        }
        rules = yaml.safe_load(RULES.read_text())
        severity = {}
        for rule in rules["groups"][0]["rules"]:
            severity[rule["alert"]] = rule["labels"]["severity"]
            del rule["annotations"]  # promtool would want them verbatim
        self.assertEqual(set(firing), set(severity))

        def labels_text(labels: dict) -> str:
            return ",".join(f'{k}="{v}"' for k, v in labels.items())

        case = {
            "interval": "15s",
            "input_series": [
                {"series": f"{name}{{{labels_text(labels)}}}", "values": values}
                for name, labels, values in series
            ],
            "alert_rule_test": [
                {
                    "eval_time": "10m",
                    "alertname": alert,
                    "exp_alerts": [
                        {"exp_labels": {**labels, "severity": severity[alert]}}
                        for labels in peers
                    ],
                }
                for alert, peers in firing.items()
            ],
        }
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "rules.yml").write_text(yaml.safe_dump(rules))
            test = {"rule_files": ["rules.yml"], "tests": [case]}
            Path(tmp, "test.yml").write_text(yaml.safe_dump(test))
            proc = subprocess.run(
                [tool(self, "promtool"), "test", "rules", "test.yml"],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=60,
            )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


class HeldAtShareOnPrometheusTest(unittest.TestCase):
    STUCK, HEALTHY = "10.0.0.1:8998", "10.0.0.2:8998"

    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = Path(tmp.name)

    def serve_metrics(self) -> int:
        """Writes a stuck and a healthy prefill with ``_PeerMetrics`` and serves
        the directory as sglang's /metrics does; returns the port."""
        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.multiprocess import MultiProcessCollector

        directory = self.tmp / "multiproc"
        directory.mkdir()
        rows = []
        for prefill, state in ((self.STUCK, 2), (self.HEALTHY, 0)):
            labels = {"tp_rank": "0", "prefill": prefill}
            rows += [
                ("sglang:pd_prefill_state", labels, state),
                ("sglang:pd_prefill_held_tokens", labels, 4096 * (state == 2)),
            ]
        failed = {"tp_rank": "0", "prefill": self.STUCK, "kind": "timeout"}
        rows.append(("sglang:pd_prefill_failures", failed, 3))
        _, PeerMetrics = peer_metrics()
        metrics = PeerMetrics(
            rows=lambda: rows,
            directory=str(directory),
            labels={"tp_rank": "0"},
            interval=3600,
        )
        self.addCleanup(metrics._thread.join, 10)  # it empties its files
        self.addCleanup(metrics.close)
        metrics.write()

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(directory))
        app = make_wsgi_app(registry)

        def text_format(environ, start_response):
            environ["HTTP_ACCEPT"] = "text/plain; version=0.0.4"  # see the module doc
            return app(environ, start_response)

        server = make_server("127.0.0.1", 0, text_format, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.addCleanup(thread.join, 10)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as resp:
            text = resp.read().decode()
        for prefill in (self.STUCK, self.HEALTHY):
            self.assertIn(f'prefill="{prefill}"', text)
        return port

    def start_prometheus(self, metrics_port: int) -> None:
        rules = self.tmp / "pd-peer-alerts.yml"
        shutil.copy(RULES, rules)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": "sglang",
                    "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                }
            ],
        }
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        self.log = self.tmp / "prometheus.log"
        with open(self.log, "wb") as log:
            self.prometheus = subprocess.Popen(
                [
                    tool(self, "prometheus"),
                    f"--config.file={self.tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.addCleanup(self.stop_prometheus)
        self.base = f"http://127.0.0.1:{port}"

    def stop_prometheus(self) -> None:
        self.prometheus.terminate()
        try:
            self.prometheus.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.prometheus.kill()
            self.prometheus.wait()

    def api(self, path: str):
        """The ``data`` of a Prometheus API answer, or None while it is not up."""
        url = f"{self.base}/api/v1/{path}"
        if self.prometheus.poll() is not None:
            self.fail(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as error:
            self.fail(f"{url}: {error}: {error.read().decode(errors='replace')}")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        self.assertEqual(body["status"], "success", body)
        return body["data"]

    def query(self, expr: str):
        data = self.api("query?" + urllib.parse.urlencode({"query": expr}))
        return None if data is None else data["result"]

    def wait_for(self, what: str, check):
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.2)
        targets = self.api("targets") or {}
        scrapes = [
            (t["scrapeUrl"], t["health"], t["lastError"])
            for t in targets.get("activeTargets", [])
        ]
        self.fail(
            f"no {what} within {DEADLINE_S:.0f} s; scrapes: {scrapes}; prometheus "
            f"log:\n{self.log.read_text()[-3000:]}"
        )

    def test_the_rule_finds_the_stuck_prefill_only(self):
        self.start_prometheus(self.serve_metrics())

        def scraped():
            result = self.query("sglang:pd_prefill_state")
            prefills = {r["metric"].get("prefill") for r in result or []}
            return prefills == {self.STUCK, self.HEALTHY}

        self.wait_for("scrape of both prefills", scraped)
        result = self.query(rule_expr("PDPrefillHeldAtShare"))
        self.assertIsNotNone(result, "prometheus stopped answering")
        got = {(r["metric"].get("prefill"), r["metric"].get("tp_rank")) for r in result}
        self.assertEqual(got, {(self.STUCK, "0")})
        (failures,) = self.query("sglang:pd_prefill_failures_total")
        self.assertEqual(failures["metric"]["kind"], "timeout")
        self.assertEqual(failures["value"][1], "3")

        def pending():
            data = self.api("alerts")
            return [
                a
                for a in (data or {}).get("alerts", [])
                if a["labels"]["alertname"] == "PDPrefillHeldAtShare"
            ]

        alerts = self.wait_for("PDPrefillHeldAtShare alert", pending)
        prefills = [a["labels"]["prefill"] for a in alerts]
        self.assertEqual(prefills, [self.STUCK])
        self.assertIn(alerts[0]["state"], {"pending", "firing"})


if __name__ == "__main__":
    unittest.main()
