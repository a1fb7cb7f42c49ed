output "nats_url" {
  description = "KVF_NATS_URL of every node: the NATS servers' fixed addresses."
  value       = local.nats_url
}

output "ingress_ips" {
  description = "The control-plane nodes' addresses: ingress's load balancer targets (port var.ingress_port)."
  value       = module.control.private_ips
}

output "instances" {
  description = "Instances per pool."
  value = {
    prefill  = length(module.prefill.instance_ids)
    decode   = length(module.decode.instance_ids)
    storage  = length(module.storage.instance_ids)
    kv_index = length(module.kv_index.instance_ids)
    nats     = length(module.nats.instance_ids)
    control  = length(module.control.instance_ids)
  }
}

output "vpc_id" {
  description = "The cluster's VPC."
  value       = module.network.vpc_id
}
