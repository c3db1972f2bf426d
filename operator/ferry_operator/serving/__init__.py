"""Serving: what Ferry reads from and writes to the workloads that serve a
ModelWeights. `wiring` builds the template patch (mounts, flags, the loader
init container from `loader`, vLLM's flags from `shapes`); `workloads` reads
Deployments, StatefulSets and LeaderWorkerSets into facts and `workload_api`
applies the planner's patches (`strategic` merges a LeaderWorkerSet's
template locally); `weights_loaded` and `diagnosis` read the serving pods back
(Ready, the loader's report, why a pod is not serving)."""
