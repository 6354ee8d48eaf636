"""The lead's sign decoder of a 2-site aggregate (fedpartial_tools.bench.sign_decoding), on
updates worked out by hand: site a = [+1, -1, +1, -1], site b = [+1, +1, -1, -1] (units of lr)."""
import numpy as np
import pytest

from fedpartial_tools.bench.sign_decoding import binned_bound, concentration, decode_two_sites, decoded_shares

A = np.array([1.0, -1.0, 1.0, -1.0])
B = np.array([1.0, 1.0, -1.0, -1.0])


def test_weighted_mean_gives_both_sites_signs():
    # 0.2 a + 0.8 b = [1.0, 0.6, -0.6, -1.0]: the heavy site is sign(v); |v| = 1 where the light
    # site agrees, 0.6 where it does not
    heavy, light = decode_two_sites(0.2 * A + 0.8 * B)
    assert heavy.tolist() == B.tolist()
    assert light.tolist() == A.tolist()
    shares = decoded_shares([A, B], [0.2, 0.8], "mean")
    assert shares == {"agree": 0.5, "consensus_0": 0.5, "consensus_1": 1.0, "decoded_0": 1.0, "decoded_1": 1.0,
                      "bound_0": 1.0, "bound_1": 1.0}


def test_the_binned_bound_takes_the_better_reading_per_bin():
    # |v| bins (2 bins over 4 weights): {0.1, 0.2} and {0.3, 0.4}; truth agrees with sign(v) on
    # 1 of the low pair (either reading gets 1) and on 0 of the high pair (the opposite gets 2)
    v = np.array([0.1, -0.2, 0.3, -0.4])
    truth = np.array([1.0, 1.0, -1.0, 1.0])
    assert binned_bound(v, truth, bins=2) == pytest.approx(0.75)


def test_median_of_two_leaves_only_what_both_share():
    # median([a, b]) = [1, 0, 0, -1]: the lead reads the sign where both agree (half the weights)
    shares = decoded_shares([A, B], [0.2, 0.8], "median")
    assert shares["decoded_0"] == shares["decoded_1"] == 0.5
    swapped = decoded_shares([B, A], [0.2, 0.8], "median")
    assert swapped["decoded_0"] == shares["decoded_1"] and swapped["decoded_1"] == shares["decoded_0"]


def test_fresh_noise_each_round_averages_away():
    a, b = np.tile(A, 2000), np.tile(B, 2000)
    one_round = decoded_shares([a, b], [0.2, 0.8], "mean", rho=2.0, rounds=1, rng=np.random.default_rng(0))
    many = decoded_shares([a, b], [0.2, 0.8], "mean", rho=2.0, rounds=2500, rng=np.random.default_rng(0))
    assert one_round["decoded_0"] < 0.6  # the light site is near a coin flip in one round
    assert many["decoded_0"] > 0.99 and many["decoded_1"] == 1.0  # noise std 2 / 50 per weight


def test_a_fixed_mask_does_not_average_away():
    """The sites' secret factors are the same every round: 2,500 rounds of the lead's averaging
    (which bring fresh noise back to every sign) leave the light site near a coin flip."""
    a, b = np.tile(A, 2000), np.tile(B, 2000)
    many = decoded_shares([a, b], [0.2, 0.8], "mean", rho=2.0, rounds=2500, rng=np.random.default_rng(0), mask=1.0)
    assert many["decoded_0"] < 0.65
    assert decoded_shares([a, b], [0.2, 0.8], "mean", mask=0.0)["decoded_0"] == 1.0


def test_only_two_sites():
    with pytest.raises(ValueError, match="2-site"):
        decoded_shares([A, B, A], [1, 1, 1], "mean")


def test_concentration_counts_changes_near_the_median():
    # |changes| 1, 1, 1, 1.2, 0.1: median 1, band [0.75, 1.25] holds four of five
    assert concentration(np.array([1.0, 1.0, -1.0, 1.2, 0.1])) == pytest.approx(0.8)
    # a narrower band drops the 1.2
    assert concentration(np.array([1.0, 1.0, -1.0, 1.2, 0.1]), band=0.1) == pytest.approx(0.6)
    assert concentration(np.zeros(4)) == 0.0
