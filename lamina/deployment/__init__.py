"""Several instances behind one router, with cluster borrowing between their pools
(:mod:`lamina.deployment.deployment`, :mod:`lamina.deployment.borrowing`), and
:func:`start_deployment`, which builds one from a :class:`~lamina.config.DeploymentConfig` under
any placement. ``LLM`` and ``lamina launch`` both hold one; it is not a user API of its own.
"""
from __future__ import annotations

from typing import Callable

from lamina.config import DeploymentConfig, use_kernels
from lamina.deployment.deployment import Deployment
from lamina.instance import Instance, ModelInfo, launcher_for, load_model_info, start_instance
from lamina.timeline import Timeline

__all__ = ["Deployment", "start_deployment"]


def start_deployment(config: DeploymentConfig, info: ModelInfo | None = None, *,
                     timeline: Timeline | None = None, perf=None,
                     progress: Callable[[str], None] = lambda stage: None) -> Deployment:
    """Load the model (unless ``info`` is given), start ``config.instances`` instances under
    ``config.instance.placement`` and put them behind one router; with borrowing, a gManager
    (a Ray actor under the ``ray`` placement). ``perf``: the greedy placement's performance
    model (default, when ``plan_every`` is set: measured now on the compute device). On any
    failure, whatever was started is stopped. This process computes with the instances'
    kernel choices from now on (its channels' ring codec, in-process roles' kernels)."""
    if config.instance.transport == "rdma":  # refused before anything starts
        from lamina.transport.rdma import unavailable
        if (why := unavailable()) is not None:
            raise ValueError(why)
    use_kernels(config.instance.kernels)
    launcher = launcher_for(config)  # first: a role process re-running a script stops here
    instances: list[Instance] = []
    try:
        if info is None:
            progress("loading and splitting the model")
            info = load_model_info(config)
        for i in range(config.instances):
            progress(f"starting instance {i}: {config.instance.compute} compute replica(s), "
                     f"{config.instance.memory} memory node(s)")
            instances.append(start_instance(config, i, info, launcher, timeline))
        if config.lends and config.plan_every and perf is None:
            from lamina.deployment.profiling import profile_perf
            progress("profiling the performance model")
            perf = profile_perf(info.split, config.instance.device, info.dtype)
        return Deployment(instances, config, perf=perf, launcher=launcher,
                          restart=lambda i: start_instance(config, i, info, launcher, timeline))
    except BaseException:
        for inst in reversed(instances):
            inst.close()
        if launcher is not None:
            launcher.close()
        raise
