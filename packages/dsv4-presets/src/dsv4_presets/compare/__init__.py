"""Paired A/B/A serving comparisons against real vLLM servers (``dsv4 compare``).

* :mod:`.spec` parses variant SPECs and expands the run pattern;
* :mod:`.campaign` is what a campaign is (variants, benchmark, options, outcomes);
* :mod:`.runner` starts, measures and stops one real server per run, saving
  each run atomically so that a campaign resumes where it stopped, with the
  process plumbing in :mod:`.process`;
* :mod:`.rundir` is the run folder's on-disk format, shared by runner and report;
* :mod:`.server_log` reads a run's server log: vLLM's version, the plugin's state;
* :mod:`.stats` pairs runs and computes intervals (paired t, request bootstrap);
* :mod:`.report` builds the table, JSON and plot from the saved runs;
* :mod:`.resolve` turns SPECs and the bench name into commands, through the presets;
* :mod:`.cli` is the ``dsv4 compare`` command.
"""

from __future__ import annotations

from .spec import PlannedRun, VariantSpec, parse_spec, plan_runs
from .stats import Pair, bootstrap_relative_change, pair_runs, t_interval

__all__ = [
    "Pair",
    "PlannedRun",
    "VariantSpec",
    "bootstrap_relative_change",
    "pair_runs",
    "parse_spec",
    "plan_runs",
    "t_interval",
]
