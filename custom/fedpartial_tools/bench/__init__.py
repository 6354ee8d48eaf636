"""The benchmark and its experiments: the suites (:mod:`.suites`), running them (:mod:`.runner`), their
reports split by what they write (:mod:`.tables`, :mod:`.plots`, :mod:`.pseudo_labels`,
:mod:`.overlays`, the README section :mod:`.readme`, FedIA's :mod:`.fedia_report`), the ``bench``
commands (:mod:`.cli`), and the streaming, throughput and privacy experiments
(:mod:`.streaming`, :mod:`.throughput`, :mod:`.privacy`). May import the runtime,
:mod:`fedpartial_tools.data`, :mod:`~fedpartial_tools.model`, :mod:`~fedpartial_tools.jobs` and
:mod:`~fedpartial_tools.run`; no other subpackage imports it."""
