"""`Notices`: said once per owner, bounded, strict raises; `logger` is the package's logger."""
import logging

import pytest

from adaptive_sparse_attention.notices import NAME, Notices, logger


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NAME]


def test_a_message_is_said_once_per_owner_and_again_after_clear(caplog):
    first, second = Notices(), Notices()
    with caplog.at_level(logging.INFO, logger=NAME):
        for _ in range(3):
            first.say("a")
        second.say("a")
        first.clear()
        first.say("a")
    assert said(caplog) == ["a", "a", "a"]  # first owner, second owner, first owner after clear


def test_fallback_raises_in_strict_mode_and_otherwise_says_what_runs_instead_once(caplog):
    notices = Notices()
    with pytest.raises(RuntimeError, match=r"^x cannot run \(strict mode\)$"):
        notices.fallback("x cannot run", "running y", strict=True)
    assert len(notices) == 0  # a raise is not a notice
    with caplog.at_level(logging.WARNING, logger=NAME):
        notices.fallback("x cannot run", "running y", strict=False)
        notices.fallback("x cannot run", "running y", strict=False)
        notices.fallback("layer 3 runs dense: why", None, strict=False)  # the message says what runs
    assert said(caplog) == ["x cannot run; running y", "layer 3 runs dense: why"]


def test_a_bounded_record_keeps_at_most_its_limit_and_still_says_the_rest(caplog):
    notices = Notices(limit=2)
    with caplog.at_level(logging.INFO, logger=NAME):
        for m in "abcdab":
            notices.say(m)
    assert notices.said == {"a", "b"}
    assert said(caplog) == ["a", "b", "c", "d"]  # past the limit a message is said, not remembered


def test_logger_is_the_package_logger():
    assert logger() is logging.getLogger("adaptive_sparse_attention")
