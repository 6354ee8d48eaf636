"""Stable public name: ``from fedpartial_tools.recipes import FedLSMRecipe, FedAvgRecipe`` (README,
docs/USAGE.md); the recipes live in :mod:`fedpartial_tools.jobs.recipes`, their profiles in
:mod:`fedpartial_tools.jobs.profiles`."""
from fedpartial_tools.jobs.profiles import (  # noqa: F401
    CHESTXRAY14, COVID_MODEL, CT_ICH, DSB_MODEL, FEDAVG_FULL_PROFILES, FEDAVG_PARTIAL_LOSS_PROFILES, FEDAVG_PROFILES,
    FEDIA_PROFILES, FEDIRM_PROFILES, FEDLSM_PROFILES, FEDMLP_PROFILES, FULL_LABELS, HAM10000, HAM_MODEL, LESION_MODEL,
    NIH_MODEL, SEG_FULL_PROFILES, SEG_PROFILES)
from fedpartial_tools.jobs.recipes import (  # noqa: F401
    RECIPES, FedAvgFullRecipe, FedAvgPartialLossRecipe, FedAvgRecipe, FedIARecipe, FedIRMRecipe, FedLSMRecipe,
    FedMLPRecipe, FedPartialRecipe, SegFedAvgFullRecipe, SegFedAvgRecipe, export_job, recipe, rule_defaults)
