"""Model-aware placement across replicas (KServe ModelMesh's idea, our own code): any replica
answers any model, forwarding a request to a live peer that holds the routed version, and
loads go where there is room. The decision is pure (`decision`), the HTTP mechanics apart
(`forwarding` here, the ingress's placement step in hub.api.placement); `service.Placement`
joins them to the manager and membership.

Nothing is imported here, so that `hub.placement.decision` (pure) loads without the rest."""
