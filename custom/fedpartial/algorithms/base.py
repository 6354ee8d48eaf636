"""The contract between methods and FLARE.

A method is two plain-Python pieces that know nothing of FLARE:

* a :class:`ClientRule` (one file per method): given the site's data and the received global
  model + global statistics, train the model in place for one round and return the aggregate
  statistics the server needs;
* a :class:`ServerRule` (one ``aggregate`` function per method): combine the sites' weights and
  statistics into the next global weights and global statistics.

The FLARE Executor / Aggregator in ``fedpartial.flare`` only move these objects over the wire.
Statistics are dicts of small numpy arrays or numbers (counts, prototypes, relation matrices,
completeness): never per-sample values.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from fedpartial.data.types import Dataset

Stats = Dict[str, object]  # values: np.ndarray, float, int (JSON/FOBS-serialisable)

_log = logging.getLogger("fedpartial")


@dataclass
class ClientContext:
    """What a client rule may use besides the model.

    Attributes:
        site: site name (e.g. ``site-1``).
        data: the site's own data file, loaded (train split partially labelled, val split).
        device: torch device to train on.
        state_dir: a folder in the site's workspace that survives rounds and site restarts
            (FedMLP tags, FedIRM teacher, FedIA corrected masks live here).
        seed: base seed of the run; combine with the round number for repeatable rounds.
        log: ``log(message)`` writes to the site's log.
        add_scalar: ``add_scalar(tag, value, step)`` writes to TensorBoard (no-op when off).
        abort: returns True once FLARE asked the task to stop; check it inside loops.
        normalisation: ``{"mean": float, "std": float}`` applied to uint8 images / 255.
        reference: the complete-label copy of this site's train split, given ONLY to the
            diagnostics (pseudo-label precision) when the job enables them; None otherwise.
    """

    site: str
    data: Dataset
    device: "object"
    state_dir: str
    seed: int = 0
    log: Callable[[str], None] = _log.info
    add_scalar: Callable[[str, float, int], None] = lambda tag, value, step: None
    abort: Callable[[], bool] = lambda: False
    normalisation: dict = field(default_factory=lambda: {"mean": 0.5, "std": 0.5})
    reference: Optional[Dataset] = None


@dataclass
class RoundInput:
    """What the server sent for this round (besides the weights, already loaded in the model)."""

    round: int  # 0-based
    num_rounds: int
    global_stats: Stats = field(default_factory=dict)


@dataclass
class RoundResult:
    """What a client rule returns after training one round.

    Attributes:
        num_samples: weight of this site in size-weighted averaging (0 = take no part).
        stats: aggregate statistics for the server rule.
        metrics: scalars for logs / TensorBoard / metrics.json (loss, pseudo-label counts...).
    """

    num_samples: int
    stats: Stats = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)


class ClientRule:
    """Base class of a method's local-training rule. Subclasses take hyperparameters as
    constructor arguments (defaults = the paper's) and implement :meth:`train_round`."""

    #: ``classification`` or ``segmentation``: which executor / data the rule expects.
    task_kind = "classification"
    #: Constructor arguments that are the method's own contribution. A FedAvg baseline matched to
    #: the method (``--matched-to``, the bench's rows) takes every other argument: the method's
    #: local recipe (augmentation, label smoothing, views, local epochs, optimiser settings).
    CONTRIBUTION: FrozenSet[str] = frozenset()
    #: recipe arguments the FedAvg baselines name differently: ``{method's name: baseline's name}``
    RECIPE_NAMES: Dict[str, str] = {}
    #: What the rule's ``num_samples`` (its weight in the server's size-weighted average) counts:
    #: ``labelled_rows`` (train rows with a usable label), ``all_rows`` (every train row), or None
    #: (the rule says nothing). A baseline matched to the method weights its sites the same way.
    WEIGHT_BY: Optional[str] = None

    def round_steps(self, data: Dataset) -> Optional[int]:
        """Optimizer steps this rule takes in a round it trains at a site holding ``data`` (called
        on a constructed rule, before :meth:`setup`). A compute-matched baseline makes as many
        (``SupervisedClient(steps_of=...)``). None = the rule does not say."""
        return None

    def setup(self, ctx: ClientContext) -> None:
        """Called once before the first round (and again after a site restart)."""
        self.ctx = ctx

    def train_round(self, model, inp: RoundInput) -> RoundResult:
        """Train ``model`` (holding the global weights) in place for one round."""
        raise NotImplementedError


@dataclass
class SiteUpdate:
    """One site's contribution to a round, as the server rule sees it."""

    site: str
    weights: Dict[str, np.ndarray]
    num_samples: int
    stats: Stats = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class ServerContext:
    """What a server rule may use besides the updates.

    Attributes:
        round: 0-based round being aggregated.
        num_rounds: total rounds of the job.
        classifier_param_names: names of the classifier ("proxy") parameters, from the model.
        global_weights: the global weights sent out this round.
        global_stats: the global statistics sent out this round.
        log: ``log(message)``.
        report: what the rule decided this round (per-site weights, the statistics they came
            from, the rule used); the aggregator writes it to the round's ``server`` entry of
            metrics.json.
        weight_rule: how the parameters a method averages by weights are combined
            (``fedpartial.algorithms.aggregation.average_weights``): ``mean`` (weighted by the method's
            weights), ``median`` or ``trimmed_mean`` (unweighted, robust to a few bad sites).
        trim_fraction: for ``trimmed_mean``, the share of sites dropped at each end per coordinate.
    """

    round: int
    num_rounds: int
    classifier_param_names: List[str]
    global_weights: Dict[str, np.ndarray] = field(default_factory=dict)
    global_stats: Stats = field(default_factory=dict)
    log: Callable[[str], None] = _log.info
    report: Dict[str, object] = field(default_factory=dict)
    weight_rule: str = "mean"
    trim_fraction: float = 0.2


class ServerRule:
    """Base class of a method's server rule. :meth:`aggregate` is the whole rule.

    A rule that sets ``needs_classifier_names`` reads ``ServerContext.classifier_param_names``
    (class-wise averaging, shape checks of statistics); the aggregator then refuses to start
    without the job's model block.
    """

    needs_classifier_names = False
    #: global statistics that are per-class counts summed over sites: the aggregator withholds them
    #: from the sites when fewer than ``min_sites_for_shared_stats`` sites contributed (subtraction).
    summed_stats: Tuple[str, ...] = ()

    def check_stats(self, update: SiteUpdate, ctx: ServerContext) -> None:
        """Raise ``ValueError`` naming the key when ``update.stats`` is malformed (wrong size,
        NaN...). The aggregator then drops the update and logs the site's name."""

    def aggregate(self, updates: List[SiteUpdate], ctx: ServerContext) -> Tuple[Dict[str, np.ndarray], Stats]:
        """Return (new global weights, new global statistics)."""
        raise NotImplementedError
