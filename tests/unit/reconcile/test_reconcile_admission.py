"""Admission (:mod:`pilotfish.reconcile.admission`) alone, with a trial build that is a plain
function: which problems a proposed state adds, and which source each one's names come from."""

from __future__ import annotations

from collections.abc import Mapping

from pilotfish.build.desired import DesiredState
from pilotfish.errors import Problem
from pilotfish.reconcile.admission import Admission
from pilotfish.resources.services import Endpoint, ServiceSpec

WEB = ServiceSpec(name="web", listen=("127.0.0.1", 10000))
API = ServiceSpec(name="api", listen=("127.0.0.1", 10000))  # the same port: the trial below says so


def state(*specs: ServiceSpec, ports: tuple[int, ...] = (9001,)) -> DesiredState:
    return DesiredState(
        services={s.name: s for s in specs},
        endpoints={s.name: tuple(Endpoint("127.0.0.1", p) for p in ports) for s in specs},
    )


class Trial:
    """A stand-in build: two services on one listen port are a problem. Counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, states: Mapping[str, DesiredState]) -> list[Problem]:
        self.calls += 1
        listening: dict[tuple[str, int], str] = {}
        problems = []
        for source in sorted(states):
            for name, spec in sorted(states[source].services.items()):
                if spec.listen is None:
                    continue
                other = listening.setdefault(spec.listen, name)
                if other != name:
                    problems.append(Problem(f"services.{name}.listen", f"port taken by {other!r}"))
        return problems


def test_a_state_that_adds_a_problem_is_refused_with_the_sources_named() -> None:
    states = {"file": state(WEB)}
    trial = Trial()
    admission = Admission(states, trial, labels={"file": "snap.yaml", "registry": "the registry"})
    problems = admission.check("registry", state(API))
    assert problems == [Problem("services.api.listen", "port taken by 'web' [services.api: defined by the registry]")]
    assert states == {"file": state(WEB)}, "checking changes nothing"


def test_a_problem_another_source_already_has_does_not_refuse_a_change() -> None:
    states = {"file": state(WEB, API)}  # already broken, by the file alone
    admission = Admission(states, Trial())
    assert admission.check("registry", state(ServiceSpec(name="db", listen=None))) == []


def test_a_change_of_endpoints_alone_is_accepted_without_a_build() -> None:
    states = {"file": state(WEB), "registry": state(WEB, ports=(9001,))}
    trial = Trial()
    admission = Admission(states, trial)
    assert admission.check("registry", state(WEB, ports=(9001, 9002))) == []
    assert trial.calls == 0
    # Endpoints for a service no source defines would add its cluster: that is built.
    assert (
        admission.check(
            "registry",
            DesiredState(
                services={"web": WEB},
                endpoints={"web": (Endpoint("127.0.0.1", 9001),), "new": (Endpoint("127.0.0.1", 9003),)},
            ),
        )
        == []
    )
    assert trial.calls == 1
