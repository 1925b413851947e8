"""The files a run reads, checked before anything compiles.

A configuration names files (``data.sources``, ``schedule.link_curves``, a
``schedule.profile`` file)
that are only opened deep inside a run, some after a long compilation. The
command line calls :func:`check_input_files` first, so that a missing,
unreadable or malformed file is one :class:`~jaxmoe.config.ConfigError` line
within seconds. The checks read the files rather than trust their names; the
configuration itself does no I/O (it is built and compared in many places). A ``.bin``
corpus is checked through its sidecar (:mod:`jaxmoe.data.corpus`: dtype, size, the
tokenizer's vocabulary against ``model.vocab_size``, the end-of-document id that
``data.mask_across_documents`` needs) without reading its ids.
"""

from __future__ import annotations

from jaxmoe.config import Config, ConfigError, ScheduleConfig
from jaxmoe.data.mixture import load_mixture
from scheduling import CollectiveCurves


def check_link_curves(schedule: ScheduleConfig) -> None:
    """``schedule.link_curves`` is a curve set the scheduler's cost model can use, and a
    profile file (``schedule.profile``) a profile."""
    if isinstance(schedule.profile, str) and schedule.profile.endswith(".json"):
        try:
            schedule.device_profile  # noqa: B018 (read to be checked)
        except (OSError, ValueError, TypeError) as error:
            raise ConfigError(
                f"schedule.profile={schedule.profile!r}: cannot read this profile file "
                f"({error}); give the JSON of a DeviceProfile, as in scheduling/profiles/"
            ) from None
    path = schedule.link_curves
    if path is None:
        return
    where = f"schedule.link_curves={path!r}"
    try:
        CollectiveCurves.load(path)
    except OSError as error:
        reason = (error.strerror or str(error)).lower()
        raise ConfigError(f"{where}: {reason}; give a file written by jaxmoe link-curves") from None
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None


def check_input_files(config: Config) -> None:
    """Read and validate every file the configuration names; ConfigError on the first bad one."""
    # The default corpus (the standard library) is not a user's file; the run reads it.
    if config.data.sources:
        load_mixture(config)
    check_link_curves(config.schedule)
