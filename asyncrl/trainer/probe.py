"""The trainer's side of the flip check (``transport.weights.probe_text``; the check and
the generator's side: ``asyncrl.weights.probe``): every rank scores the probe with each
version it publishes, and rank 0 compares the generators' reports with its own scores."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import zmq

from asyncrl.trainer.dist import DistInfo
from asyncrl.transport import RunSite, bind, server_socket, write_endpoints
from asyncrl.weights.probe import policy_logprobs, probe_tokens
from asyncrl.wire import ProbeReport, WireDecoder

log = logging.getLogger(__name__)

KEEP_VERSIONS = 64
"""The trainer's logprobs kept per version: a report about an older version (a generator
that fell this far behind) is not compared."""


class TrainerProbe:
    """The trainer's side: its logprobs of every version it publishes (each rank), and
    rank 0's comparison with what the generators report."""

    def __init__(self, site: RunSite, model_path: str, info: DistInfo, lineage: str) -> None:
        self.wcfg, self.info, self.lineage = site.transport.weights, info, lineage
        self.tokens = probe_tokens(model_path, self.wcfg.probe_text)
        self.scores: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.alarms = 0
        self.pull: zmq.Socket | None = None
        if info.is_main:
            t, run_dir = site.transport, site.run_dir
            self.ctx = zmq.Context()
            self.pull = server_socket(self.ctx, zmq.PULL, t, run_dir)
            endpoint = bind(self.pull, t, run_dir, "trainer-probe")
            write_endpoints(run_dir, "probe", {"reports": endpoint})
            self.decoder = WireDecoder(site.run_id, expected=ProbeReport)

    def after_publish(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Score the probe with weights ``version``, just published (every rank), and
        compare the reports that came in since the last call; rank 0's scalars."""
        self.scores[version] = policy_logprobs(model, self.tokens, self.info.device)
        while len(self.scores) > KEEP_VERSIONS:
            self.scores.popitem(last=False)
        if self.pull is None:
            return {}
        diffs = [d for d in map(self._compare, self._reports()) if d is not None]
        scalars = {"weights/probe_alarms": float(self.alarms)}
        if diffs:
            scalars |= {
                "weights/probe_max_abs_diff": max(diffs),
                "weights/probe_reports": len(diffs),
            }
        return scalars

    def _reports(self) -> list[ProbeReport]:
        reports = []
        while self.pull.poll(0):
            report = self.decoder.try_decode(self.pull.recv(), "probe reports")
            if report is not None and report.lineage == self.lineage:
                reports.append(report)  # another lineage's versions are another trainer's
        return reports

    def _compare(self, report: ProbeReport) -> float | None:
        mine = self.scores.get(report.version)
        if mine is None:
            return None
        if len(report.logprobs) != len(mine):
            log.error(
                "generator %s scored %d probe tokens, the trainer %d: another tokenizer?",
                report.worker_id,
                len(report.logprobs) + 1,
                len(mine) + 1,
            )
            return None
        diff = float((torch.tensor(report.logprobs) - mine).abs().max())
        if diff > self.wcfg.probe_alarm:
            self.alarms += 1
            message = (
                f"generator {report.worker_id} decodes with weights v{report.version} whose "
                f"probe logprobs differ from the trainer's by {diff:.4g} nats "
                f"(transport.weights.probe_alarm={self.wcfg.probe_alarm}): the engine does not "
                f"run the published weights"
            )
            log.error("%s", message)
            if self.wcfg.probe_stop:
                raise RuntimeError(message + " (transport.weights.probe_stop)")
        return diff

    def close(self) -> None:
        if self.pull is not None:
            self.pull.close(linger=0)
            self.ctx.term()
