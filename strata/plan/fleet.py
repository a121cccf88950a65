"""A discrete-event simulation of one architecture: the real engines (instance.py), the real
routing policies (strata.gateway.routing.policies), on one virtual clock. Nothing sleeps.

Events, in time order from one heap:

    arrive    a turn reaches the gateway (routing.py: the gateway's own instance set, pipeline,
              policy and P/D decider); with `instance_slots` (the gateway's --instance-slots)
              it waits in the gateway's FIFO while every routable instance has that many in
              flight (or none is routable), and is sent when one finishes or one is ready;
              under P/D the decider may hand its prompt to a prefill instance, else the
              pipeline picks an instance; the request reaches the engine after the request
              overhead, a session read (sessions external/hybrid) and a KV fetch (KV offload:
              the stored run of blocks past the local prefix hit)
    admit     the engine takes it; an idle instance starts a step
    step      an engine step ends (it ran when it started, its outputs are released now): first
              tokens and finishes are recorded, a finished turn sends the job's next turn after
              the think time, a prefill under P/D hands its KV to a decode instance
    ready     a started instance (the autoscaler's) takes requests
    handoff   a decode instance takes a prefilled request (its blocks imported, the first token
              released to the client now); which prompts go through a prefill instance is the
              gateway's decider's call (its rules: length, the prefill backlog, sessions)
    tick      the autoscaler (autoscaled.py) decides

A request's TTFT is from its arrival at the gateway to its first token; TPOT is (finish - first
token) / (output tokens - 1), as `strata bench` measures them.

The instances are the real engine (instance.py), or with `modelled=True` the capacity model
(modelled.py: two releases per request instead of an engine step per token, for the hours of
traffic the autoscaler's stories run). Everything else is the same simulation.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strata.autoscale.capacity import CapacityModel
from strata.clock import ManualClock
from strata.engine.outputs import RequestOutput
from strata.engine.request import Request, SamplingParams
from strata.plan.arch import Architecture
from strata.plan.costs import Costs
from strata.plan.instance import EngineShape, FleetInstance, SimInstance
from strata.plan.modelled import ModelledInstance
from strata.plan.routing import Routed, SimGateway
from strata.plan.watch import SloWatch
from strata.plan.workload import Job, Workload, build_jobs
from strata.sim.profile import LatencyProfile
from strata.types import BlockHash, RequestId


@dataclass(slots=True)
class Turn:
    """One request's measurements (seconds on the virtual clock)."""

    arrival_s: float
    num_prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None  # its last token
    answered_s: float | None = None  # the turn ended: last token, then a `strong` store write
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _Flight:
    job: Job
    turn_index: int
    turn: Turn
    routed: Routed
    request: Request
    prompt_len: int

    @property
    def instance(self) -> FleetInstance:
        return self.routed.instance


@dataclass(slots=True)
class FleetResult:
    turns: list[Turn] = field(default_factory=list)
    instance_seconds: float = 0.0
    busy_seconds: float = 0.0
    busy_by_instance: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_fetched_tokens: int = 0
    duration_s: float = 0.0
    max_instances: int = 0
    is_stopped_early: bool = False  # the SLO was surely missed (watch.py)


# the events that bring work: while one is pending the fleet is not done
_WORK_EVENTS = frozenset(("arrive", "admit", "handoff"))


class Fleet:
    """One architecture over `workload` (its jobs, or `jobs` when given: e.g. `poisson_jobs`
    for a load that varies in time). `initial_replicas` overrides the architecture's count
    (0: an autoscaled fleet that starts from zero; `instance_slots` must then hold arrivals)."""

    def __init__(self, arch: Architecture, profile: LatencyProfile, workload: Workload, *,
                 shape: EngineShape | None = None, costs: Costs | None = None,
                 seed: int = 0, jobs: list[Job] | None = None, modelled: bool = False,
                 instance_slots: int = 0, initial_replicas: int | None = None) -> None:
        self.arch, self.workload = arch, workload
        self.costs = costs or Costs()
        self.profile = self.costs.tensor_parallel.scale(profile, arch.tp)
        self.shape = shape or EngineShape()
        self.clock = ManualClock()
        self.rng = random.Random(seed)
        self.overhead_rng = random.Random(seed)  # its own stream: draws move no other choice
        self.events: list[tuple[float, int, str, Any]] = []
        self._count = 0
        self.instances: list[FleetInstance] = []
        self.prefill: list[FleetInstance] = []
        self.pd_min_tokens = self.costs.pd_min_tokens(self.profile)
        self.gateway = SimGateway(arch.policy, self.shape.block_size, self.costs, self.rng,
                                  self.clock, pd_min_tokens=self.pd_min_tokens)
        self.flights: dict[RequestId, _Flight] = {}
        self.result = FleetResult()
        self._next_id = 0
        self.jobs = build_jobs(workload) if jobs is None else jobs
        self._next_job = 0
        self._num_work_events = 0
        self.on_tick: Callable[[], None] | None = None
        self.watch: SloWatch | None = None
        self.model = CapacityModel(self.profile, self.shape.max_num_seqs, 1.0) \
            if modelled else None
        self.instance_slots = instance_slots
        self.held: deque[tuple[Job, int, Turn, Request]] = deque()  # waiting at the gateway
        self.first_tokens: list[tuple[float, float]] = []  # (when, TTFT s), in time order
        if initial_replicas is None:
            initial_replicas = 1 if arch.autoscale else arch.replicas
        if initial_replicas < 1 and not instance_slots:
            raise ValueError("a fleet of no instance holds its arrivals only with slots")
        for _ in range(arch.num_prefill):
            self.prefill.append(self.add_instance(role="prefill"))
        for _ in range(initial_replicas):
            self.add_instance()

    @property
    def now(self) -> float:
        return self.clock.now

    def push(self, t: float, kind: str, payload: Any = None) -> None:
        self._count += 1
        if kind in _WORK_EVENTS:
            self._num_work_events += 1
        heapq.heappush(self.events, (t, self._count, kind, payload))

    def add_instance(self, *, role: str = "mixed", ready_s: float = 0.0) -> FleetInstance:
        instance_id = f"i{len(self.instances):03d}"
        instance: FleetInstance = (
            SimInstance(instance_id, self.profile, self.shape, self.clock, role=role)
            if self.model is None else ModelledInstance(instance_id, self.model, role=role))
        instance.started_at = self.now
        if ready_s > 0:
            instance.view.state = "starting"
            self.push(self.now + ready_s, "ready", instance)
        self.instances.append(instance)
        self.gateway.add(instance)
        return instance

    def run(self, until_s: float | None = None) -> FleetResult:
        """Every event in time order; with `until_s`, none after it (the run's cost and
        duration end there)."""
        if self.workload.concurrency is None:
            for job in self.jobs:
                self.push(job.start_s, "arrive", (job, 0))
            self._next_job = len(self.jobs)
        else:
            for _ in range(min(self.workload.concurrency, len(self.jobs))):
                self._start_next_job()
        if self.on_tick is not None:
            self.push(0.0, "tick")
        while self.events:
            if self.watch is not None and self.watch.is_hopeless:
                self.result.is_stopped_early = True
                break
            if until_s is not None and self.events[0][0] > until_s:
                self.clock.set(until_s)
                break
            t, _, kind, payload = heapq.heappop(self.events)
            if kind in _WORK_EVENTS:
                self._num_work_events -= 1
            self.clock.set(t)
            getattr(self, f"_on_{kind}")(payload)
        return self._finish()

    def is_done(self) -> bool:
        return not self.flights and not self.held and self._next_job >= len(self.jobs) \
            and not self._num_work_events

    def _start_next_job(self) -> None:
        if self._next_job < len(self.jobs):
            job = self.jobs[self._next_job]
            self._next_job += 1
            job.start_s = self.now
            self.push(self.now, "arrive", (job, 0))

    def _on_tick(self, _: Any) -> None:
        assert self.on_tick is not None
        self.on_tick()

    def _on_ready(self, instance: FleetInstance) -> None:
        instance.view.state = "ready"
        self._send_held()

    def _on_arrive(self, payload: tuple[Job, int]) -> None:
        job, index = payload
        prompt = (job.history or job.prefix_token_ids) + job.turns[index].user_token_ids
        turn = Turn(self.now, len(prompt))
        self.result.turns.append(turn)
        request = self._request(prompt, job.turns[index].output_len)
        if self.instance_slots and (self.held or not self._has_room()):
            self.held.append((job, index, turn, request))
            return
        self._send(job, index, turn, request)

    def _has_room(self) -> bool:
        """The gateway's --instance-slots: fewer in flight than slots x routable instances."""
        routable = [i.view for i in self.instances
                    if i.view.is_routable and i.view.role != "prefill"]
        return sum(v.num_in_flight for v in routable) < self.instance_slots * len(routable)

    def _send_held(self) -> None:
        while self.held and self._has_room():
            self._send(*self.held.popleft())

    def _send(self, job: Job, index: int, turn: Turn, request: Request) -> None:
        prefill = self.gateway.prefill_for(request, self._stored_session(job)) \
            if self.prefill else None
        if prefill is not None:
            request.sampling_params = SamplingParams(max_tokens=1, ignore_eos=True)
            request.kv_export = True
            routed = self.gateway.send_prefill(prefill, request)
        else:
            routed = self.gateway.route(request, job.session_id)
        instance = routed.instance
        delay_ms = self.costs.request_overhead(self.overhead_rng)
        if self.arch.sessions in ("external", "hybrid") and index > 0:
            delay_ms += self.costs.session_read_ms
        if self.arch.kv_offload:
            num_tokens = self.gateway.attach_stored_kv(instance, request)
            self.result.num_fetched_tokens += num_tokens
            delay_ms += self.costs.kv_fetch_ms(num_tokens) if num_tokens else 0.0
        self.flights[request.request_id] = _Flight(job, index, turn, routed, request,
                                                   turn.num_prompt_tokens)
        self.push(self.now + delay_ms / 1000, "admit", (instance, request))

    def _stored_session(self, job: Job) -> str | None:
        """The session id the instances see: with server-side sessions only (the gateway's
        decider keeps a stored session's turn on one instance)."""
        return job.session_id if self.arch.sessions else None

    def _request(self, prompt: list[int], max_tokens: int) -> Request:
        self._next_id += 1
        return Request(RequestId(f"r{self._next_id}"), prompt,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       arrival_time=self.now)

    def _on_admit(self, payload: tuple[FleetInstance, Request]) -> None:
        instance, request = payload
        instance.add(request)
        self._kick(instance)

    def _kick(self, instance: FleetInstance) -> None:
        for delay_s, outputs in instance.advance(self.now):
            self.push(self.now + delay_s, "step", (instance, outputs))

    def _on_step(self, payload: tuple[FleetInstance, list[RequestOutput]]) -> None:
        instance, outputs = payload
        instance.released(self.now, outputs)
        for output in outputs:
            flight = self.flights[output.request_id]
            if flight.turn.first_token_s is None and instance.view.role == "mixed":
                self._first_token(flight.turn)
                flight.turn.num_cached_tokens = output.num_cached_tokens
            if output.finished:
                self._finished(flight, output)
        self._kick(instance)

    def _finished(self, flight: _Flight, output: RequestOutput) -> None:
        del self.flights[flight.request.request_id]
        instance, view = flight.instance, flight.instance.view
        self.gateway.finished(flight.routed, output.kv_blocks)
        if view.role == "prefill":
            flight.turn.num_cached_tokens = output.num_cached_tokens
            num_tokens = len(output.kv_blocks) * self.shape.block_size
            self.push(self.now + self.costs.transfer_ms(num_tokens) / 1000, "handoff",
                      (flight, output.kv_blocks))
            return
        if instance.stopped_at is None and view.is_draining and not instance.has_work:
            instance.stopped_at = self.now
        self._turn_done(flight)
        self._send_held()

    def _first_token(self, turn: Turn) -> None:
        turn.first_token_s = self.now
        self.first_tokens.append((self.now, self.now - turn.arrival_s))
        if self.watch is not None:
            self.watch.first_token(self.now - turn.arrival_s)

    def _turn_done(self, flight: _Flight) -> None:
        turn = flight.turn
        turn.finish_s = self.now
        turn.num_output_tokens = flight.request.num_output_tokens + (
            flight.request.num_prompt_tokens - flight.prompt_len)
        if self.watch is not None and turn.first_token_s is not None:
            self.watch.finished((self.now - turn.first_token_s) / (turn.num_output_tokens - 1)
                                if turn.num_output_tokens > 1 else None)
        turn.answered_s = self.now + self.costs.session_write_s(self.arch.sessions)
        job, index = flight.job, flight.turn_index
        job.history = flight.request.all_token_ids
        if index + 1 < len(job.turns):
            self.push(turn.answered_s + self.workload.think_time_s, "arrive", (job, index + 1))
        elif self.workload.concurrency is not None:
            self._start_next_job()

    def _on_handoff(self, payload: tuple[_Flight, list[tuple[BlockHash, bytes]]]) -> None:
        flight, blocks = payload
        self._first_token(flight.turn)
        prefilled = flight.request
        left = flight.job.turns[flight.turn_index].output_len - 1
        if left <= 0:
            self._turn_done(flight)
            return
        request = self._request(prefilled.all_token_ids, left)
        request.external_kv = dict(blocks)
        routed = self.gateway.route(request, flight.job.session_id)
        self.flights[request.request_id] = _Flight(flight.job, flight.turn_index, flight.turn,
                                                   routed, request, flight.prompt_len)
        self._on_admit((routed.instance, request))

    def _finish(self) -> FleetResult:
        out = self.result
        out.duration_s = self.now
        for instance in self.instances:
            end = instance.stopped_at if instance.stopped_at is not None else self.now
            out.instance_seconds += end - instance.started_at
            out.busy_by_instance.append(instance.busy_s)
            out.num_preemptions += instance.num_preemptions
        out.busy_seconds = sum(out.busy_by_instance)
        out.max_instances = max(out.max_instances, len(self.instances))
        return out


__all__ = ["Fleet", "FleetResult", "Turn"]
