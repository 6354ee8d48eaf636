"""The component classes a job without code may name at a fedpartial site or server.

FLARE checks every component path of a job that carries no code (``app/custom``) against the
``class_allow_list`` of the site's ``local/resources.json``: an entry matches a path exactly (or as
a package prefix when it ends in ``.``). This list is what provisioning
(:class:`fedpartial_tools.deploy.builders.SitePolicyBuilder`) writes there, in place of FLARE's
default list: exact class paths only, so no module function, no test-only component (e.g.
``fedpartial.flare.recorder.MessageRecorder``, which writes messages to any folder a config names) and
no FLARE component the shipped jobs do not use (log streamers, peer-to-peer Swarm / Cyclic
controllers, which hand a site's result to another site where no privacy filter applies).

Add a class here only when a shipped job, a recipe variant or ``provisioning/privacy.json`` names
it; ``tests/test_kit_policy.py`` checks every exported job against this list.
"""

#: fedpartial components: the executor, server aggregator, persistor, model locator and model
#: selector of every job; the privacy filters (statistics filter of the jobs; weight-diff pair of
#: ``fedpartial_tools.bench.privacy``); the site's result policy and guards of ``provisioning/privacy.json``
#: (and the update mask a site may add to it, docs/DEPLOYMENT.md §6).
FEDPARTIAL_COMPONENTS = (
    "fedpartial.flare.aggregators.RuleAggregator",
    "fedpartial.flare.executors.FedPartialExecutor",
    "fedpartial.flare.filters.RestoreFullWeights",
    "fedpartial.flare.filters.SendWeightDiff",
    "fedpartial.flare.filters.StatisticsPrivacyFilter",
    "fedpartial.flare.persistor.FedPartialModelLocator",
    "fedpartial.flare.persistor.FedPartialPersistor",
    "fedpartial.flare.result_policy.SiteResultPolicy",
    "fedpartial.flare.selector.PooledModelSelector",
    "fedpartial.flare.site_policy.FedEventGuard",
    "fedpartial.flare.site_policy.LocalModelGate",
    "fedpartial.flare.site_policy.UpdateMask",
)

#: FLARE components the shipped jobs and recipes use (workflows, shareable generator, model
#: selector, validation JSON, TensorBoard analytics) and the weight filter of
#: ``fedpartial_tools.bench.privacy`` (PercentilePrivacy).
FLARE_COMPONENTS = (
    "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
    "nvflare.app_common.shareablegenerators.full_model_shareable_generator.FullModelShareableGenerator",
    "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
    "nvflare.app_common.widgets.intime_model_selector.IntimeModelSelector",
    "nvflare.app_common.widgets.validation_json_generator.ValidationJsonGenerator",
    "nvflare.app_common.workflows.cross_site_model_eval.CrossSiteModelEval",
    "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather",
    "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
    "nvflare.app_opt.tracking.tb.tb_writer.TBWriter",
)

#: the ``class_allow_list`` of every provisioned site and server kit (exact dotted class paths)
CLASS_ALLOW_LIST = FEDPARTIAL_COMPONENTS + FLARE_COMPONENTS
