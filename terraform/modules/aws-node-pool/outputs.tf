output "instance_ids" {
  description = "The pool's instances, in order."
  value       = aws_instance.this[*].id
}

output "private_ips" {
  description = "The pool's primary private addresses, in order."
  value       = aws_instance.this[*].private_ip
}

output "placement_group" {
  description = "The pool's placement group, null without one."
  value       = var.placement_strategy == null ? null : aws_placement_group.this[0].name
}
