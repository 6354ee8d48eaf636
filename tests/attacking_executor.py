"""Test-only: a site executor that lies. Never shipped: tests/test_e2e_robust.py copies it into a
job's app/custom for one simulator run."""
from nvflare.apis.dxo import MetaKey, from_shareable
from nvflare.apis.fl_constant import ReturnCode

from fedpartial.flare.executors import FedPartialExecutor


class AttackingExecutor(FedPartialExecutor):
    """FedPartialExecutor whose site ``attack_site`` claims ``claimed_samples`` samples and sends
    its trained weights multiplied by ``scale``; every other site behaves normally.

    Args:
        attack_site: the lying site's name.
        claimed_samples: the sample count it reports.
        scale: factor on every floating-point weight it sends.
        **kwargs: FedPartialExecutor's arguments.
    """

    def __init__(self, attack_site: str = "site-3", claimed_samples: int = 10 ** 6, scale: float = 100.0, **kwargs):
        super().__init__(**kwargs)
        self.attack_site, self.claimed_samples, self.scale = attack_site, int(claimed_samples), float(scale)

    def _train(self, shareable, fl_ctx, abort_signal):
        out = super()._train(shareable, fl_ctx, abort_signal)
        if self.site != self.attack_site or out.get_return_code() != ReturnCode.OK:
            return out
        dxo = from_shareable(out)
        dxo.data = {k: v * self.scale if v.dtype.kind == "f" else v for k, v in dxo.data.items()}
        dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, self.claimed_samples)
        return dxo.to_shareable()
