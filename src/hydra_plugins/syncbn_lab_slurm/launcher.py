"""Hydra's submitit SLURM launcher, with jobs that end without a result reported as failed.

A job killed from outside (scancel, the time limit, the OOM killer) never returns to
submitit, and the plugin's launcher then raises submitit's UncompletedJobError for the
whole multirun while the other jobs go on. This launcher waits for every job instead,
writes ``<run dir>/error.json`` for such a job (its one-line reason: the SLURM job id and
state), and lets :class:`syncbn_lab.multirun.ReportFailures` list it with the other failed
jobs. Everything else is the plugin's ``SlurmLauncher`` (``hydra-submitit-launcher``, the dev and
slurm extras); without the plugin this module defines nothing, so that Hydra's scan of
``hydra_plugins`` stays quiet.

``configs/hydra/launcher/submitit_slurm.yaml`` names it:
``_target_: hydra_plugins.syncbn_lab_slurm.launcher.SlurmLauncher``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf, open_dict

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _Plugin
except ImportError:  # hydra-submitit-launcher is not installed: no SLURM launcher
    _Plugin = None

log = logging.getLogger(__name__)


class SlurmLauncher(_Plugin if _Plugin is not None else object):
    """The plugin's SLURM launcher; a job that ends without a result is a failed job."""

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None
        # The executor and its parameters as the plugin builds them.
        params = dict(self.params)
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR,
            folder=params.pop("submitit_folder"),
            slurm_max_num_timeout=params.pop("max_num_timeout"),
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()}
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"submitting {len(job_overrides)} SLURM job(s); run dirs under {sweep_dir}")
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"  job {idx}: {' '.join(filter_overrides(overrides))}")
            state = Singleton.get_state()
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", state))
        jobs = executor.map_array(self, *zip(*job_params, strict=True))
        returns = []
        for (overrides, _, idx, _, _), job in zip(job_params, jobs, strict=True):
            try:
                returns.append(job.results()[0])
            except submitit.core.utils.UncompletedJobError:
                returns.append(self._no_result(overrides, idx, job))
        return returns

    def _no_result(self, overrides: list[str], idx: int, job) -> JobReturn:
        """Record a job that ended without a result as a failed job of its run dir."""
        from syncbn_lab.multirun import record_failure

        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        line = (
            f"SLURM job {job.job_id} ended without a result ({job.state}); its log: "
            f"{job.paths.stderr}"
        )
        record_failure(cfg, run_dir, line)
        return JobReturn(
            overrides=overrides,
            cfg=cfg,
            working_dir=str(run_dir),
            task_name=str(cfg.hydra.job.name),
            status=JobStatus.COMPLETED,  # failed, but recorded: the other jobs' results count
            _return_value=None,
        )
