"""What orchestrates the roles, in the driver: data, advantages, publishing a policy version,
evaluation, the run's state, the watchdog, metrics. Imports the roles; no role imports it."""
