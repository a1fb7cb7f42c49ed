output "plan" {
  description = "The sizing: GPUs, super-nodes, storage, node pools and where each service runs."
  value = {
    fleet              = module.plan.fleet
    storage            = module.plan.storage
    storage_tier       = module.plan.storage_tier
    decode_super_nodes = module.plan.decode_super_nodes
    node_pools         = module.plan.node_pools
    placement          = module.plan.placement
  }
}

output "instances" {
  description = "Instances per pool, as built."
  value       = module.cluster.instances
}

output "nats_url" {
  description = "The NATS servers, as every node is told."
  value       = module.cluster.nats_url
}

output "ingress_ips" {
  description = "Ingress's load balancer targets."
  value       = module.cluster.ingress_ips
}
