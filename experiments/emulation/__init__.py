"""The emulated cluster: H hosts on one Linux machine, each a network namespace, joined by
shaped links, running one process each as one distributed jaxmoe run.

Where things are:

- ``network``: the namespaces, the bridge and the link shaping (``EmulatedNetwork``,
  ``LinkShape``); needs root and iproute2.
- ``link_probe`` and ``link_calibration``: whether a shaped link behaves like a wire of
  its rate; every measurement on a shaped link starts with ``calibrated_network``.
- ``hosts``: ``EmulatedHosts``, one process per host through ``jaxmoe.cli.launch``.
- ``host_process``: inside a host, a host program's arguments and its start through
  ``jaxmoe.prepare.start_process``.
- Host programs, each with the launcher-side function that runs it and returns its typed
  result: ``step_rounds`` (training steps of several schedules, interleaved),
  ``collectives_only`` (a step's collectives replayed alone), ``overlap_control`` (the
  control that shows whether the cluster overlaps at all), ``placement_rounds``,
  ``grad_sync_runs``; ``link_curves`` runs ``jaxmoe link-curves`` on the hosts.
- ``schedule_runs``: one whole measurement of several schedules (calibration, control,
  shaped and unshaped link, collectives alone, link curves), ``experiments.cluster``'s.
- ``overlap_regime``: the regime the overlap evaluations share; ``instrument_model``:
  the cluster as the simulator sees it.
"""
