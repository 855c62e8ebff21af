"""The embedded stack's warm runner: Prefect's ``Runner`` with each flow run started from a forkserver
whose server has already imported Prefect's engine and our flow modules.

Prefect's runner starts every served run as ``python -m prefect.engine``: a fresh interpreter that
spends ~2 s importing Prefect before the flow body starts. Here the same engine entry point runs in a
child forked from a preloaded server (tens of milliseconds), and everything else stays Prefect's:
polling, Pending/Running states, logs, cancellation (SIGTERM then SIGKILL of the child), the Crashed
state of a child that dies, the concurrency limit and the health server. Each run still has a process
of its own, forked from a server that never runs flows, so no run sees another's module state and a
run that crashes takes only itself down.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
import runpy
import socket
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.runner import Runner
from prefect.runner._process_manager import ProcessHandle
from prefect.runner._scheduled_run_poller import ScheduledRunPoller

from sluicegate.errors import StackError

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner._control_channel import ControlChannel

log = logging.getLogger(__name__)

# What every flow run imports before its body starts (prefect.engine's own imports, the flow engine
# and run metrics); the flow modules of the served deployments are added to these.
ENGINE_MODULES = ("prefect.engine", "prefect.flow_engine", "prefect._internal.metrics", __name__)


def forkserver_context(preload: Iterable[str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver context the runner starts runs from, its server importing ``preload`` once.

    The server is started here, not at the first run, so its imports are paid while the runner starts
    (before it reports healthy) rather than by the first event's run.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(dict.fromkeys([*ENGINE_MODULES, *preload])))
    probe = context.Process(target=_ready, name="forkserver-probe")
    probe.start()
    probe.join()
    if probe.exitcode != 0:
        raise StackError(
            f"the runner's forkserver could not start a process (exit code {probe.exitcode}); the runner log "
            "has its error. SLUICEGATE_PREFECT__RUNNER_WARM=false starts runs in fresh interpreters instead."
        )
    return context


def _ready() -> None:
    """A probe child: proves the forkserver forks."""


def run_flow_run(flow_run_id: str, env: dict[str, str]) -> None:
    """The child's body: what ``python -m prefect.engine FLOW_RUN_ID`` does, in a forked interpreter.

    Running the engine module's own ``__main__`` block (rather than a copy of it) keeps the run's
    loading, signal handling, control channel and exit codes exactly Prefect's; its imports are
    already in ``sys.modules`` here. It leaves by ``SystemExit``, which multiprocessing turns into the
    exit code the runner reads.
    """
    os.environ.update(env)
    sys.argv = ["prefect.engine", flow_run_id]
    if not any(name.startswith("PREFECT_") and not name.startswith("PREFECT__") for name in env):
        # Only internal variables (PREFECT__*, read from the environment where used): the settings the
        # server read at its start are this run's too, and reading them again costs ~40 ms.
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    from prefect.context import SettingsContext, get_settings_context
    from prefect.settings import Settings

    # A setting of this run's own (the heartbeat): read the settings again with this run's environment,
    # as run_flow_in_subprocess does for its children.
    with SettingsContext(profile=get_settings_context().profile, settings=Settings()):
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


class ForkserverStarter:
    """A Prefect ``ProcessStarter``: the flow run in a child of the preloaded forkserver.

    It sets the environment ``EngineCommandStarter`` gives ``python -m prefect.engine`` (flow run id,
    deployment name, control-channel port and token, heartbeat), hands the runner the process, and
    returns once the child has exited.
    """

    def __init__(
        self,
        context: multiprocessing.context.ForkServerContext,
        *,
        client: PrefectClient,
        deployment_name: str | None,
        control_channel: ControlChannel | None,
        heartbeat_seconds: float | None,
        storage_base_path: str | None,
    ) -> None:
        self._context = context
        self._client = client
        self._deployment_name = deployment_name
        self._control_channel = control_channel
        self._heartbeat_seconds = heartbeat_seconds
        self._storage_base_path = storage_base_path

    def environment(self, flow_run: FlowRun) -> tuple[dict[str, str], bool]:
        """The child's extra environment, and whether the control channel registered the run."""
        env = {
            "PREFECT__FLOW_RUN_ID": str(flow_run.id),
            # The runner, not the child, runs on_crashed / on_cancellation hooks (as with Prefect's starter).
            "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS": "false",
        }
        if self._deployment_name is not None:
            env["PREFECT__DEPLOYMENT_NAME"] = self._deployment_name
        if self._storage_base_path is not None:
            env["PREFECT__STORAGE_BASE_PATH"] = self._storage_base_path
        if self._heartbeat_seconds is not None:
            env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = str(int(self._heartbeat_seconds))
        registered = False
        if self._control_channel is not None:
            try:
                port, token = self._control_channel.register(flow_run.id)
            except RuntimeError:
                # No loopback listener: cancellation falls back to kill only, as in Prefect's starters.
                pass
            else:
                env["PREFECT__CONTROL_PORT"], env["PREFECT__CONTROL_TOKEN"] = str(port), token
                registered = True
        return env, registered

    async def start(
        self,
        flow_run: FlowRun,
        task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        env, registered = self.environment(flow_run)
        process = self._context.Process(
            target=run_flow_run, args=(str(flow_run.id), env), name=f"flow-run-{flow_run.id}"
        )
        try:
            # A thread: start() blocks on the forkserver's socket, and restarts a server that died.
            await anyio.to_thread.run_sync(process.start)
        except BaseException:
            if registered and self._control_channel is not None:
                self._control_channel.unregister(flow_run.id)
            raise
        task_status.started(ProcessHandle(process))  # type: ignore[arg-type]  # has pid and exitcode
        await self._record_pid(flow_run, process.pid)
        await anyio.to_thread.run_sync(process.join, abandon_on_cancel=True)

    async def _record_pid(self, flow_run: FlowRun, pid: int | None) -> None:
        """The run's process on the flow run (``host:pid``, as Prefect's process worker records it): the
        process is a child of the forkserver, and nothing in its command line or environment names the run."""
        try:
            await self._client.update_flow_run(flow_run.id, infrastructure_pid=f"{socket.gethostname()}:{pid}")
        except Exception as exc:  # the run goes on without it
            log.warning("could not record process %s of flow run %s: %s", pid, flow_run.id, exc)


class WakingPoller(ScheduledRunPoller):
    """Prefect's poller, which also polls at once when the server announces a scheduled run of ours.

    Prefect's poll interval is the wait a triggered run sees, on average half of it; polling often
    instead costs the server a query and a write each time (it marks the deployments as polled), and
    on SQLite those writes collide with the trigger's own (a collision costs the run 2 s: the client
    backs off). The flow-run events arrive over the websocket Prefect's own cancellation observer
    uses; the interval poll stays for scheduled runs that come due and for a lost connection.
    """

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(super().run)
            group.start_soon(self._poll_on_scheduled_runs)

    async def _poll_on_scheduled_runs(self) -> None:
        from prefect.events.clients import get_events_subscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

        ids = [f"prefect.deployment.{d}" for d in self._deployment_registry.get_deployment_ids()]
        wanted = EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.Scheduled"]), related=EventRelatedFilter(id=ids)
        )
        while not self.stopping:
            try:
                async with get_events_subscriber(filter=wanted, reconnect_on_clean_close=True) as events:
                    async for _ in events:
                        await self._get_and_submit_flow_runs()
            except Exception as exc:
                log.warning(
                    "no flow-run events (%s): polling every %.1f s only, until they return", exc, self._query_seconds
                )
                await anyio.sleep(30)


class WarmRunner(Runner):
    """Prefect's runner, starting each run with a ``ForkserverStarter`` and polling on flow-run events."""

    def __init__(self, context: multiprocessing.context.ForkServerContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._forkserver = context

    async def __aenter__(self) -> WarmRunner:
        await super().__aenter__()
        # Runner builds its poller, and the poller's starter factory, inside __aenter__ and has no
        # parameter to choose others; replacing the poller keeps every other part of the runner as
        # Prefect wrote it. A Prefect upgrade that changes these arguments fails here, loudly, and
        # tests/flows/test_warm_runner.py fails if runs stop going through the forkserver.
        old = self._scheduled_run_poller
        self._scheduled_run_poller = WakingPoller(
            query_seconds=old._query_seconds,
            prefetch_seconds=old._prefetch_seconds,
            client=old._client,
            limit_manager=old._limit_manager,
            deployment_registry=old._deployment_registry,
            resolve_starter=self._starter,
            runs_task_group=old._runs_task_group,
            storage_objs=old._storage_objs,
            process_manager=old._process_manager,
            state_proposer=old._state_proposer,
            hook_runner=old._hook_runner,
            cancellation_manager=old._cancellation_manager,
            get_attempt_conclusion=old._get_attempt_conclusion,
        )
        return self

    def _starter(self, flow_run: FlowRun) -> ForkserverStarter:
        name = None
        if flow_run.deployment_id is not None:
            name = self._deployment_registry.get_deployment_name(flow_run.deployment_id)
        return ForkserverStarter(
            self._forkserver,
            client=self._client,
            deployment_name=name,
            control_channel=self._control_channel,
            heartbeat_seconds=self._heartbeat_seconds,
            storage_base_path=str(self._tmp_dir),
        )


def flow_modules(deployments: Sequence[RunnerDeployment]) -> list[str]:
    """The modules the deployments' flows live in (``flows.pipeline`` for ``flows.pipeline.pipeline``)."""
    return [d.entrypoint.rsplit(".", 1)[0] for d in deployments if d.entrypoint and ":" not in d.entrypoint]


def serve_warm(
    deployments: Sequence[RunnerDeployment],
    *,
    poll_seconds: float,
    limit: int | None,
    preload: Iterable[str] = (),
) -> None:
    """Serve ``deployments`` until SIGTERM or Ctrl-C, as ``prefect.serve`` does, starting runs warm."""
    import asyncio

    from prefect.exceptions import TerminationSignal

    context = forkserver_context([*flow_modules(deployments), *preload])
    runner = WarmRunner(context, query_seconds=poll_seconds, limit=limit)
    for deployment in deployments:
        runner.add_deployment(deployment)
    log.info("serving %s; runs start from a forkserver", ", ".join(d.name for d in deployments))
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal) as exc:
        log.info("received %s, shutting down", type(exc).__name__)
