"""Runtime expert placement: which device's slots hold a copy of which expert.

- :mod:`jaxmoe.placement.replicas`: the replica tables (no JAX beyond arrays).
- :mod:`jaxmoe.placement.copy_split`: each step, an expert's rows split over its copies.
- :mod:`jaxmoe.placement.routing_history`: the smoothed routed load a placement is
  planned from.
- :mod:`jaxmoe.placement.planner`: the replicas re-planned while training.
"""
