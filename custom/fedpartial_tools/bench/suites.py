"""Bench suites: which dataset, partition, method job and baselines each suite runs, the settings
of each profile (``cpu`` / ``gpu``) and of each variant, and the settings a baseline shares with
its method (same model, local recipe and rounds).
"""


from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from fedpartial_tools.data.combine import StatedSource
from fedpartial_tools.jobs import folders, matching, settings


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DEFAULT_DATA = os.path.abspath(os.path.join(REPO, "..", "shared", "data"))


@dataclass
class Suite:
    """One comparison: a dataset + scenario, the method job, its lower / upper bound baselines."""

    dataset: str
    scenario: str
    split_options: Dict[str, object]
    sites: int
    method: str
    lower: str
    upper: str
    others: List[str] = field(default_factory=list)
    metrics: List[str] = field(default_factory=lambda: ["auc", "f1", "accuracy", "bacc", "map"])
    overrides: Dict[str, List[str]] = field(default_factory=dict)  # profile -> --set items
    # profile -> --set items of the method job and its variants only (e.g. FedIA's warm-up length)
    method_overrides: Dict[str, List[str]] = field(default_factory=dict)
    # Ablations: label -> extra --set items of the method job, run and reported as a job of their own.
    variants: Dict[str, List[str]] = field(default_factory=dict)
    # label -> a baseline job run matched to the method in compute and weighting too: the method's
    # optimizer steps per round at every site (batches from the baseline's labelled rows) and its
    # site weights (jobs.matching.compute_of). The other baselines keep their own epochs.
    compute_matched: Dict[str, str] = field(default_factory=dict)
    # profile -> another file of the same data (e.g. the GPU profile's larger images)
    datasets: Dict[str, str] = field(default_factory=dict)
    # a fedpartial_tools.data.synthetic function making ``dataset`` (seed 0) into <out>/_data when absent
    generator: str = ""
    # CPU-profile settings that differ from the method job as shipped, each with the reason (every
    # other CPU-profile setting is already the job's default: the shipped jobs reproduce the tables)
    cpu_departures: Dict[str, str] = field(default_factory=dict)
    # a fedpartial_tools.data.synthetic function shifting the test images (another acquisition): "<metric>_shift"
    shifted_test: str = ""
    # leave-one-patient-out: this patient id of the dataset's train split is the test split, the
    # other patients' slices are shared out among the sites (made once into <out>/_data)
    holdout_patient: Optional[int] = None
    # sliced sources brought to ``agreement`` and combined into ``dataset``, made once into
    # <out>/_data (fedpartial_tools.data.combine.combine_npz); with holdout_patient, that patient's
    # slices are the test split (combine.hold_out_patient)
    combine: Tuple[StatedSource, ...] = ()
    # the input agreement (a JSON file, relative to the repository) the sources are brought to;
    # every job gets it as model.input_agreement (server and client) and its size as model.input_size
    agreement: str = ""
    # combined sources with holdout_patient: share of each training patient's slices that becomes
    # the val split (seeded per patient, never the held-out patient; 0 = no val split)
    val_fraction: float = 0.0
    # sites whose slices with a second rater's mask (``*_masks_rater2``) train and validate on it
    # instead of the first rater's; their reference copies keep the first rater's
    rater2_sites: Tuple[str, ...] = ()

    def dataset_for(self, profile: str) -> str:
        """The data file the ``profile`` runs on."""
        return self.datasets.get(profile, self.dataset)

    @property
    def jobs(self) -> List[str]:
        return [self.lower, *self.compute_matched, *self.others, self.upper, self.method, *self.variants]

    def agreement_sets(self) -> List[str]:
        """``--set`` items giving every job the suite's input agreement, on the server (which
        writes it into the model file) and the clients (which check their site files against it),
        and the agreement's slice size as ``model.input_size``; ``[]`` without an agreement."""
        if not self.agreement:
            return []
        from fedpartial.data.grid import load_agreement

        agreement = load_agreement(os.path.join(REPO, self.agreement)).to_dict()
        value = json.dumps(agreement, separators=(",", ":"))
        return [f"server.model.input_agreement={value}", f"client.model.input_agreement={value}",
                f"model.input_size={json.dumps(agreement['size'], separators=(',', ':'))}"]

    def job_folder(self, job: str) -> str:
        """The job that runs row ``job``: a name of ``jobs/`` or ``RECIPE:PROFILE`` (a variant runs
        the method's)."""
        job = self.method if job in self.variants else self.compute_matched.get(job, job)
        return PROFILE_ROWS.get(job, job)


# Rows that run a recipe's other profile than the shipped one (results.csv and the docs name them so).
PROFILE_ROWS = {"fedlsm_multilabel": "fedlsm:multilabel", "fedmlp_ctich": "fedmlp:ctich",
                "fedirm_multilabel": "fedirm:multilabel", "fedia_lesions": "fedia:lesions",
                "fedavg_seg_lesions": "fedavg_seg:lesions", "fedavg_seg_full_lesions": "fedavg_seg_full:lesions"}


_CPU_CLS = ["model.arch=small_cnn", "rule_args.lr=0.001"]
_PREMISE_CPU = ["num_rounds=30", "rule_args.local_epochs=3"]
_PREMISE_DEPARTURES = {"rule_args.local_epochs": "3: the premise is memorised label noise, which needs more "
                                                  "local steps than 30 rounds of one epoch give (control: -e1)"}
# FedMLP's options one at a time (fedpartial.algorithms.fedmlp: paper / released code / ours)
_FEDMLP_FIDELITY = {"fedmlp_paper_thresholds": ["rule_args.t0=0.005", "rule_args.t1=0.01"],
                    "fedmlp_cr_in_warmup": ["rule_args.cr_in_warmup=true"],
                    "fedmlp_la_annotated": ["rule_args.la_prior=annotated_frequency"],
                    "fedmlp_adaptive_warmup": ["rule_args.warmup_end=learning_degree", "rule_args.warmup_rounds=15",
                                               "rule_args.min_warmup_rounds=3"]}
# the paper's tagging thresholds, the candidate beside the shipped 0.05 / 0.1
_FEDMLP_PAPER = {"fedmlp_paper_thresholds": _FEDMLP_FIDELITY["fedmlp_paper_thresholds"]}
# FedIRM's suspects for "the unlabelled sites do not help", one ablation each: the weight of the
# relation-matching loss and of both unlabelled losses (relation matching + consistency), the
# entropy filter's pass rate, the teacher's drift (EMA decay), how much the unlabelled sites'
# updates weigh in aggregation, and the class imbalance of the pseudo labels.
_FEDIRM_SUSPECTS = {"fedirm_relation_w0": ["rule_args.relation_weight=0.0"],
                    "fedirm_relation_w3": ["rule_args.relation_weight=3.0"],
                    "fedirm_unsup_w0.3": ["rule_args.max_unsupervised_weight=0.3"],
                    "fedirm_unsup_w3": ["rule_args.max_unsupervised_weight=3.0"],
                    "fedirm_pass80": ["rule_args.reliable_fraction=0.8"],
                    "fedirm_pass20": ["rule_args.reliable_fraction=0.2"],
                    "fedirm_ema999": ["rule_args.ema_decay=0.999"],
                    "fedirm_ema9": ["rule_args.ema_decay=0.9"],
                    "fedirm_unlabelled_w1": ["rule_args.unlabelled_weight=1.0"],
                    "fedirm_unlabelled_w0.25": ["rule_args.unlabelled_weight=0.25"],
                    # class imbalance of the pseudo labels: the reliable share taken per predicted class
                    "fedirm_per_class": ["rule_args.reliable_per_class=true"],
                    # no unlabelled loss teaches classes: self-training on the reliable pseudo labels
                    "fedirm_pseudo": ["rule_args.pseudo_label_weight=1.0"],
                    "fedirm_pseudo_balanced": ["rule_args.pseudo_label_weight=1.0", "rule_args.pseudo_label_balance=true"],
                    # unlabelled sites join at 20 of 30; 0 is the paper's
                    "fedirm_join10": ["rule_args.unlabelled_start_round=10"],
                    "fedirm_join0": ["rule_args.unlabelled_start_round=0"]}
# FedIRM's rows also score best_global_model.pt ("_best"): with the unlabelled sites the validation
# AUC rises where the last aggregate's test AUC need not, and the two models tell that apart
_FEDIRM_METRICS = ["auc", "accuracy", "f1", "bacc", "auc_best", "f1_best"]
# FedIRM's GPU profile: the paper's network (DenseNet-121 with MC dropout) at 64 px
_FEDIRM_GPU = ["model.arch=densenet121", "model.arch_args={\"dropout\":0.2}", "num_rounds=100"]
# positive tags only where the annotating sites' check tags are >= 70 % precise (ours, off in the paper)
_FEDMLP_GATE = {"fedmlp_tag_gate": ["rule_args.positive_tag_gate=0.7"]}
# FedMLP without its logit adjustment (imbalance handling the matched baselines take too): what the
# rest of the method adds
_FEDMLP_NO_LA = {"fedmlp_no_wpc": ["rule_args.use_wpc=false"]}
# FedMLP's Table 3: each part taken away in turn (missing-label detection, the warm-up's partial-class
# loss, consistency with the global model); the paper's order is that each adds
_FEDMLP_TABLE3 = {"fedmlp_no_mld": ["rule_args.use_mld=false"], **_FEDMLP_NO_LA, "fedmlp_no_cr": ["rule_args.use_cr=false"]}
# FedAvg with the method's steps per round and site weights, beside FedAvg with its own epochs
_COMPUTE = {"fedavg_compute": "fedavg"}
SUITES: Dict[str, Suite] = {
    "fedlsm-ham": Suite("ham10000_28.npz", "label-set-mismatch", {"classes_per_site": 3}, 5, "fedlsm", "fedavg",
                        "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                        overrides={"cpu": _CPU_CLS + ["num_rounds=50"],
                                   "gpu": ["model.arch=densenet121", "model.arch_args={}", "num_rounds=50"]},
                        # tau80: thresholds picked by validation AUC (seed 0: 0.95 / 0.9 / 0.8) for the
                        # CPU profile's small model, which is rarely 95 % sure. The job ships the paper's
                        # pseudo-label rule (chosen on the val split over renormalise_missing, 3 seeds)
                        variants={"fedlsm_renormalised": ["rule_args.renormalise_missing=true"],
                                  "fedlsm_tau80": ["rule_args.tau=0.8", "rule_args.tau_l=0.7"]},
                        datasets={"gpu": "ham10000_64.npz"},
                        # auc_shift / f1_shift: the same test images through another "camera"
                        metrics=["auc", "f1", "accuracy", "bacc", "map", "auc_shift", "f1_shift"],
                        shifted_test="acquisition_shift"),
    "fedlsm-nih": Suite("nih_chestxray14_64.npz", "label-set-mismatch", {"classes_per_site": 3}, 8,
                        "fedlsm_multilabel", "fedavg", "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                        metrics=["auc", "map", "f1", "bacc"],
                        # the class-weighted BCE uses the server's class counts (FedLSM's statistics);
                        # without it, what FedLSM adds beyond a weighting FedAvg does not have
                        variants={"fedlsm_unweighted": ["rule_args.class_weighted_bce=false"]},
                        overrides={"cpu": _CPU_CLS + ["num_rounds=20"], "gpu": ["model.arch=densenet121",
                                                                               "model.arch_args={}", "num_rounds=50"]}),
    "fedmlp-ctich": Suite("ct_ich_128.npz", "label-set-mismatch", {"classes_per_site": 1}, 5, "fedmlp_ctich",
                          "fedavg", "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                          metrics=["auc", "map", "bacc", "f1"],
                          # positive tags capped by the class's prevalence at the annotating sites
                          variants={"fedmlp_prevalence_cap": ["rule_args.positive_tag_cap=prevalence"],
                                    # FedLSM's class-wise row averaging (over the annotating sites) for
                                    # FedMLP's classifier
                                    "fedmlp_annotated_rows": ["rule_args.classifier_rows=annotated"],
                                    # untagged missing entries count as negatives (weight 1),
                                    # as FedAvg counts them; right for 94-99 % of them at this prevalence
                                    "fedmlp_assumed_negative": ["rule_args.assumed_negative_weight=1.0"],
                                    **_FEDMLP_PAPER, **_FEDMLP_NO_LA, **_FEDMLP_GATE},
                          overrides={"cpu": _CPU_CLS + ["num_rounds=30", "model.input_size=[64,64]"],
                                     "gpu": ["model.arch=resnet18", "model.arch_args={}", "num_rounds=100"]}),
    "fedmlp-nih": Suite("nih_chestxray14_64.npz", "missing-classes", {"missing_per_site": 7}, 8, "fedmlp",
                        "fedavg", "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                        metrics=["auc", "map", "bacc", "f1"],
                        variants={"fedmlp_prevalence_cap": ["rule_args.positive_tag_cap=prevalence"], **_FEDMLP_PAPER,
                                  **_FEDMLP_NO_LA, **_FEDMLP_GATE},
                        overrides={"cpu": _CPU_CLS + ["num_rounds=30"],
                                   "gpu": ["model.arch=resnet18", "model.arch_args={}", "num_rounds=100"]}),
    # FedMLP's premise: a site that does not annotate class c trains on c's positives as negatives,
    # label noise that a long training memorises. 5 sites of 600 images, 1 annotated class each,
    # prevalence 0.15-0.45 (the paper's 13-23 % and above), 3 local epochs per round. The data is
    # fixed (synthetic.make_premise_multilabel, written before FedMLP ran on it); when the
    # baselines' gap is too small the setting gets harder (epochs, rounds), never the data easier.
    "fedmlp-premise": Suite("premise_multilabel_32.npz", "label-set-mismatch", {"classes_per_site": 1}, 5, "fedmlp",
                            "fedavg", "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                            metrics=["auc", "map", "bacc", "f1"],
                            generator="make_premise_multilabel",
                            variants={**_FEDMLP_FIDELITY, **_FEDMLP_TABLE3, **_FEDMLP_GATE},
                            cpu_departures=_PREMISE_DEPARTURES,
                            overrides={"cpu": _CPU_CLS + _PREMISE_CPU}),
    # control: prevalence x 0.1 (CT-ICH's 1.5-4.5 %); the mechanism predicts a smaller margin
    "fedmlp-premise-rare": Suite("premise_multilabel_rare_32.npz", "label-set-mismatch", {"classes_per_site": 1}, 5,
                                 "fedmlp", "fedavg", "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                                 metrics=["auc", "map", "bacc", "f1"], generator="make_premise_multilabel_rare",
                                 variants={**_FEDMLP_FIDELITY, **_FEDMLP_GATE},
                                 overrides={"cpu": _CPU_CLS + _PREMISE_CPU},
                                 cpu_departures=_PREMISE_DEPARTURES),
    # control: one local epoch per round (less memorising); the mechanism predicts a smaller margin
    "fedmlp-premise-e1": Suite("premise_multilabel_32.npz", "label-set-mismatch", {"classes_per_site": 1}, 5,
                               "fedmlp", "fedavg", "fedavg_full", ["fedavg_partial_loss"], compute_matched=_COMPUTE,
                               metrics=["auc", "map", "bacc", "f1"], generator="make_premise_multilabel",
                               variants=_FEDMLP_FIDELITY,
                               overrides={"cpu": _CPU_CLS + _PREMISE_CPU[:-1] + ["rule_args.local_epochs=1"]}),
    "fedirm-ham": Suite("ham10000_28.npz", "semi-supervised", {"labelled_sites": 2}, 10, "fedirm", "fedavg",
                        "fedavg_full", metrics=_FEDIRM_METRICS, compute_matched=_COMPUTE,
                        overrides={"cpu": _CPU_CLS + ["num_rounds=30"], "gpu": _FEDIRM_GPU},
                        # the method's own recipe on the labelled sites alone: the like-for-like lower bound
                        variants={"fedirm_labelled_only": ["rule_args.unlabelled_start_round=1000000"],
                                  # the job ships our rule (lowest-entropy half reliable, unlabelled
                                  # sites weigh 0.05 of their size; see docs/RESULTS.md): the paper's
                                  # ln 2 filter and plain sample weighting
                                  "fedirm_paper": ["rule_args.reliable_fraction=0.0", "rule_args.unlabelled_weight=1.0"],
                                  **_FEDIRM_SUSPECTS},
                        datasets={"gpu": "ham10000_64.npz"}),
    # FedIRM's premise: labelled sites too few to learn alone. One labelled site of ten (10 % of the
    # images); the baselines are run first and fedirm_labelled_only must sit clearly below fedavg_full.
    "fedirm-ham-1l": Suite("ham10000_28.npz", "semi-supervised", {"labelled_sites": 1}, 10, "fedirm", "fedavg",
                           "fedavg_full", metrics=_FEDIRM_METRICS, compute_matched=_COMPUTE,
                           overrides={"cpu": _CPU_CLS + ["num_rounds=30"], "gpu": _FEDIRM_GPU},
                           variants={"fedirm_labelled_only": ["rule_args.unlabelled_start_round=1000000"],
                                     "fedirm_paper": ["rule_args.reliable_fraction=0.0",
                                                      "rule_args.unlabelled_weight=1.0"],
                                     **_FEDIRM_SUSPECTS},
                           datasets={"gpu": "ham10000_64.npz"}),
}
# The candidate rule for sparse lesions, run on both DSB2018 and the small-lesion suites: whole
# missed lesions at 0.8, warm-up counted from the first lesion the model marks, and a correction
# that changed nothing does not use up the site's one correction.
# whole missed lesions instead of pixels (fedpartial.algorithms.fedia.correct_masks_lesionwise)
_LESIONWISE = ["rule_args.correction_rule=lesions", "rule_args.correction_threshold=0.8"]
# + warm-up counted from the first lesion the model marks (learning starts late)
_LESIONWISE_LATE = _LESIONWISE + ["rule_args.warmup_from_first_lesion=true"]
_LESIONWISE_LATE_RETRY = _LESIONWISE_LATE + ["rule_args.retry_empty_correction=true"]


for _m in range(4):
    # FedIA, paper setting: site k (0..3) keeps (20k - 10m + 40) % of its lesions.
    SUITES[f"fedia-dsb-m{_m}"] = Suite(
        "dsb2018_nuclei_256.npz", "incomplete-masks",
        {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia", "fedavg_seg",
        # "_native": each image at the file's 256 px (the model's 64 px probabilities upsampled); the
        # file keeps no image at its original size, so 256 px is the finest there is
        "fedavg_seg_full", metrics=["dice_native", "iou_native", "dice", "iou"],
        # like with like: fedia switches to plain FedAvg once every site has corrected, which a
        # run without correction never reaches; fedia_keep_weighting is fedia with completeness
        # weighting to the end, the row fedia_no_correction compares with
        variants={"fedia_no_correction": ["rule_args.use_correction=false"],
                  "fedia_keep_weighting": ["rule_args.fedavg_after_all_corrected=false"],
                  # the job ships threshold 0.95 (it won at m = 0..3; docs/results/results.csv names
                  # that row fedia_threshold95 and the paper's 0.8 fedia)
                  "fedia_paper_threshold": ["rule_args.correction_threshold=0.8"],
                  "fedia_lesionwise": _LESIONWISE, "fedia_lesionwise_late_retry": _LESIONWISE_LATE_RETRY},
        overrides={"cpu": ["num_rounds=30", "model.input_size=[64,64]", "rule_args.lr=0.001"],
                   "gpu": ["num_rounds=100", "model.input_size=[256,256]"]})


# Real MS lesions on FLAIR (2 patients, native 182x218, lesion burden 35-fold apart), leave one
# patient out: the other patient's slices go to 4 sites keeping (20k - 10m + 40) % of their
# lesions, the held-out patient is the test set. The jobs run as shipped, fitted to the data's
# classes and size. Metrics of the last aggregate and of best_global_model.pt ("_best").
# fedia_lesions ships completeness weighting without correction (the correction lowered the
# within-patient val Dice here); the variants put the whole-lesion correction back (at 0.8 and
# 0.95), and fedia_lesions_paper adds to the correction the paper's weighting (no clipping, no
# readiness rule, no weight cap).
_FEDIA_PAPER_WEIGHTING = ["rule_args.completeness_cap=null", "rule_args.min_predicted_ratio=0",
                          "rule_args.completeness_max=null", "rule_args.max_weight_ratio=null"]


for _patient in (7, 19):
    for _m in (2, 3):
        SUITES[f"ms-p{_patient}-m{_m}"] = Suite(
            "ms_flair_2patients.npz", "incomplete-masks",
            {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia_lesions",
            "fedavg_seg_lesions", "fedavg_seg_full_lesions", holdout_patient=_patient,
            metrics=["dice_pooled", "dice_per_image", "dice_pooled_best", "dice_per_image_best"],
            variants={"fedia_lesions_correction": ["rule_args.use_correction=true"],
                      "fedia_lesions_t95": ["rule_args.use_correction=true", "rule_args.correction_threshold=0.95"],
                      "fedia_lesions_paper": ["rule_args.use_correction=true"] + _FEDIA_PAPER_WEIGHTING})


# Six MS patients from two sources and scanners, both in training: the two shared files brought
# to the federation's input agreement and combined (patient ids 7, 19 and 2-5 kept), one patient
# held out as the test set, 15 % of each other patient's slices the val split (choosing settings
# with --select-on val never reads the held-out patient), the rest shared out among 4 sites
# keeping (20k - 10m + 40) % of their lesions. Scored on the agreed grid and, taken back through
# the agreement's inverse, on the held-out patient's own grid ("_native").
MS6_SOURCES = (StatedSource("ms_flair_2patients.npz", (1.0, 1.0), "LAS"),
               StatedSource("ms_flair_isbi2015_4patients.npz", (0.83, 0.83), "PLS"))
MS6_PATIENTS = (7, 19, 2, 3, 4, 5)
MS6_AGREEMENT = os.path.join("provisioning", "input_agreement.json")
MS6_VAL_FRACTION = 0.15
_MS6_METRICS = ["dice_pooled", "dice_per_image", "dice_pooled_best", "dice_per_image_best", "dice_pooled_native",
                "dice_pooled_native_best"]
_MS6_DEPARTURES = {"model.input_agreement": "the sources are brought to provisioning/input_agreement.json; the "
                                            "job states it so sites check their files and the model file records it",
                   "model.input_size": "the agreement's 192 x 224 slices (fedia:lesions ships 128 px; resizing "
                                       "would undo the agreed 1 mm spacing)"}


def _ms6_suite(patient: int, completeness: Sequence[float], rater2_sites: Sequence[str] = ()) -> "Suite":
    """One ms6 suite.

    Args:
        patient: the held-out patient id.
        completeness: per site, the share of its lesions kept.
        rater2_sites: sites given the second rater's masks (:attr:`Suite.rater2_sites`).
    """
    return Suite("ms6_flair_agreed.npz", "incomplete-masks", {"completeness": list(completeness)}, 4,
                 "fedia_lesions", "fedavg_seg_lesions", "fedavg_seg_full_lesions", holdout_patient=patient,
                 metrics=list(_MS6_METRICS),
                 # the profile's departures from the paper put back: correction, weighting, both
                 variants={"fedia_lesions_correction": ["rule_args.use_correction=true"],
                           "fedia_lesions_paper_weighting": list(_FEDIA_PAPER_WEIGHTING),
                           "fedia_lesions_paper": ["rule_args.use_correction=true"] + _FEDIA_PAPER_WEIGHTING},
                 combine=MS6_SOURCES, agreement=MS6_AGREEMENT, val_fraction=MS6_VAL_FRACTION,
                 rater2_sites=tuple(rater2_sites), cpu_departures=dict(_MS6_DEPARTURES))


for _patient in MS6_PATIENTS:
    for _m in (2, 3):
        SUITES[f"ms6-p{_patient}-m{_m}"] = _ms6_suite(_patient, [(20 * k - 10 * _m + 40) / 100 for k in range(4)])
# The second rater as a real incomplete annotation: no lesion dropped by the bench, but sites 1
# and 2 train (and validate) on rater 2's masks wherever a slice has one (the ISBI patients);
# the complete-mask bound and the test score use rater 1's.
for _patient in MS6_PATIENTS:
    SUITES[f"ms6-p{_patient}-r2"] = _ms6_suite(_patient, [1.0] * 4, rater2_sites=("site-1", "site-2"))

#: suites run together by ``bench --suite-group NAME``
SUITE_GROUPS: Dict[str, List[str]] = {
    "ms6": [f"ms6-p{p}-m{m}" for p in MS6_PATIENTS for m in (2, 3)],
    "ms6-r2": [f"ms6-p{p}-r2" for p in MS6_PATIENTS],
}
#: the metric a group's summary table compares (default: its suites' first): the held-out
#: patient on its own grid
GROUP_METRICS: Dict[str, str] = {"ms6": "dice_pooled_native", "ms6-r2": "dice_pooled_native"}


def suite_names(suites: Sequence[str] = (), groups: Sequence[str] = ()) -> List[str]:
    """``suites`` then each group's suites (:data:`SUITE_GROUPS`), each once, in that order.

    Args:
        suites: names of :data:`SUITES`.
        groups: names of :data:`SUITE_GROUPS`.

    Raises:
        ValueError: naming an unknown suite or group.
    """
    unknown = [g for g in groups if g not in SUITE_GROUPS]
    if unknown:
        raise ValueError(f"unknown suite group {unknown}; groups: {sorted(SUITE_GROUPS)}")
    names = list(dict.fromkeys([*suites, *(n for g in groups for n in SUITE_GROUPS[g])]))
    missing = [n for n in names if n not in SUITES]
    if missing:
        raise ValueError(f"unknown suite {missing}")
    return names


def job_settings(job: str, sets: Sequence[str] = ()) -> dict:
    """The effective ``model`` block, client ``rule_args`` and ``num_rounds`` of a job (a name of
    ``jobs/``, ``RECIPE:PROFILE`` or a row of :data:`PROFILE_ROWS`) after ``sets``."""
    return settings.job_settings(folders.find_job(PROFILE_ROWS.get(job, job)), sets)


def profile_departures(suite: "Suite", profile: str = "cpu") -> List[str]:
    """Settings (``model.<key>``, ``rule_args.<key>``, ``num_rounds``) that ``profile`` changes on
    the suite's method job as shipped."""
    shipped = job_settings(suite.method)
    run = job_settings(suite.method, list(suite.overrides.get(profile, [])) + suite.agreement_sets()
                       + list(suite.method_overrides.get(profile, [])))
    keys = [f"model.{k}" for k in sorted(set(shipped["model"]) | set(run["model"]))
            if shipped["model"].get(k) != run["model"].get(k)]
    keys += [f"rule_args.{k}" for k in sorted(set(shipped["rule_args"]) | set(run["rule_args"]))
             if shipped["rule_args"].get(k) != run["rule_args"].get(k)]
    return keys + (["num_rounds"] if shipped["num_rounds"] != run["num_rounds"] else [])


def matched_sets(suite: "Suite", job: str, sets: Sequence[str] = ()) -> List[str]:
    """``--set`` items giving a baseline ``job`` of ``suite`` its method's model, local recipe and
    rounds, and for a row of ``compute_matched`` its steps and site weights too
    (:func:`fedpartial_tools.jobs.matching.matched_sets`), after the common ``sets``; ``[]`` for
    the method and its variants. FedIRM's like-for-like lower bound is its own job with the
    unlabelled sites never joining (the ``fedirm_labelled_only`` row)."""
    if suite.job_folder(job) == suite.job_folder(suite.method):
        return []
    return matching.matched_sets(folders.find_job(suite.job_folder(suite.method)),
                                 folders.find_job(suite.job_folder(job)), sets, compute=job in suite.compute_matched)


# Small sparse lesions: MS-like slices made by fedpartial_tools.data.synthetic (128 px native, lesions
# 2-12 px across, 0.2 % of the pixels, 6 of 10 slices empty), the FedIA paper's site completeness,
# training at native resolution. lesions-m*: the paper's plain Dice loss and uniform batches for every
# job; lesions-dicece-m*: Dice + cross-entropy and half of each batch from slices with a lesion, for
# every job (a setting of the segmentation path, not of one method). lr 1e-2: at 1e-3 the 450 local
# steps of 30 rounds leave every job predicting no lesion (pooled Dice 0 for fedavg_seg_full, seed 0);
# at 1e-2 the full-label model reaches 0.92. Even so no job marks a lesion before round ~13, so FedIA's
# warm-up (paper: 10 MS / 40 lung; a property of the learning curve) is 20 of 40 rounds: after 10 the
# warm-up model predicts no lesion and the completeness estimate has nothing to count.
_LESION_CPU = ["num_rounds=40", "model.input_size=[128,128]", "rule_args.lr=0.01"]
_LESION_WARMUP = ["rule_args.warmup_rounds=20"]
_LESION_CE = ["rule_args.loss=dice_ce", "rule_args.lesion_fraction=0.5"]


for _m in (2, 3):
    for _name, _extra in ((f"lesions-m{_m}", []), (f"lesions-dicece-m{_m}", _LESION_CE)):
        SUITES[_name] = Suite(
            "small_lesions_128.npz", "incomplete-masks",
            {"completeness": [(20 * k - 10 * _m + 40) / 100 for k in range(4)]}, 4, "fedia", "fedavg_seg",
            "fedavg_seg_full", metrics=["dice_pooled", "dice_per_image", "dice", "iou"],
            generator="make_small_lesions",
            cpu_departures={"model.input_size": "the synthetic lesion set's native 128 px (fedia ships DSB2018's 64 px)",
                            "rule_args.loss": "the suite's loss", "rule_args.lesion_fraction": "the suite's batches",
                            "rule_args.lr": "1e-2: at 1e-3 no job learns a lesion in 30 rounds of 15 steps",
                            "rule_args.warmup_rounds": "20: no model marks a lesion before round ~13",
                            "num_rounds": "40: 20 warm-up rounds, then 20 of FedIA proper"},
            method_overrides={"cpu": _LESION_WARMUP, "gpu": ["rule_args.warmup_rounds=40"]},
            variants={"fedia_paper_threshold": ["rule_args.correction_threshold=0.8"],
                      "fedia_lesionwise": _LESIONWISE, "fedia_lesionwise_late": _LESIONWISE_LATE,
                      "fedia_lesionwise_late_retry": _LESIONWISE_LATE_RETRY},
            overrides={"cpu": _LESION_CPU + _extra,
                       "gpu": ["num_rounds=100", "model.input_size=[128,128]", "rule_args.lr=0.01"] + _extra})


def suites_of(rows: Sequence[dict]) -> List[str]:
    """The suites present in ``rows``, in the order of :data:`SUITES` (so that a re-run suite keeps
    its place in the reports)."""
    order = {name: i for i, name in enumerate(SUITES)}
    return sorted(dict.fromkeys(r["suite"] for r in rows), key=lambda name: order.get(name, len(order)))


def is_segmentation(name: str) -> bool:
    """Whether suite ``name`` is scored with Dice (segmentation)."""
    return any(k.startswith("dice") for k in SUITES[name].metrics)
