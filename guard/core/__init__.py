"""The guard's bottom layer: what every other package of the guard process shares (durations and sizes, secret
masking, the helper thread, the run's state, the registry of the guard's own children). Imports nothing above it
(``guard.errors``, ``guard.contract`` and ``guard.files`` aside, which import nothing of the guard's packages)."""
