"""Which checks a traced process cannot run, and why: what ``hs_tracer_check_active`` and the
``HsTracerChecksOff`` alert report (the operator drill shows it live for another model's profile)."""

from __future__ import annotations

from pathlib import Path

from hs_tracer.config import TracerConfig
from hs_tracer.core.recorder import export_setup
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.profile.model import Profile
from hs_tracer.records import Ranks, WiringRecord


class _State:
    """The fields export_setup reads of an engine adapter's tracer state."""

    def __init__(self, config: TracerConfig, findings: list[Finding], fits: bool = True,
                 identity_off: str | None = None) -> None:
        self.config, self.static_findings, self.profile_fits = config, findings, fits
        self.identity_off = identity_off
        self.wiring = WiringRecord(model="m", target_arch="A", num_layers=8, hidden_size=64,
                                   layers_to_capture=[2, 4, 5], sources=["block:1", "block:3", "block:4"])
        self.ranks, self.draft_config = Ranks(), {}


def test_every_reason_a_check_is_off(testbed_profile: Path) -> None:
    profile = Profile.load(testbed_profile)
    assert profile.expected_acceptance is not None
    on = export_setup(_State(TracerConfig(profile=testbed_profile), []))
    assert on.checks_off(profile) == {}
    assert export_setup(_State(TracerConfig(), [])).checks_off(None) == {
        "slots": "no_profile", "acceptance": "no_profile"}
    for code in (Code.PROFILE_MISMATCH, Code.PROFILE_UNREADABLE):
        unusable = export_setup(_State(TracerConfig(profile=testbed_profile),
                                       [Finding(code, Severity.WARNING, "set aside")], fits=False))
        assert unusable.profile is None
        assert unusable.checks_off(None) == {"slots": code.value, "acceptance": code.value}
    off = export_setup(_State(TracerConfig(profile=testbed_profile, identity_every=0), []))
    assert off.checks_off(profile) == {"identity": "HS_TRACER_IDENTITY_EVERY=0"}
    graphs = export_setup(_State(TracerConfig(profile=testbed_profile), [], identity_off="cuda_graphs"))
    assert graphs.checks_off(profile) == {"identity": "cuda_graphs"}
    # the setup crosses to the export process as JSON: the reason goes with it
    assert type(graphs).from_json(graphs.to_json()).identity_off == "cuda_graphs"
