"""The autoscaler: a scaling law over the fitted latency profile corrected by what is measured
(law.py, capacity.py), a leased controller that writes desired replicas to the registry's
deployments (controller.py; the launchers reconcile them). Off a live fleet the law runs on the
planner's fleet simulator (strata/plan/autoscaled.py)."""
