# One pool of identical EC2 nodes: a launch template (IMDSv2 only, detailed monitoring,
# EFA interfaces, no public address) and node_count instances from it, in a placement group
# and in capacity reservations where the pool asks for them.

locals {
  name = "${var.cluster_name}-${var.pool}"
  # With EFA the launch template carries every interface; without, the instance takes the
  # subnet, groups and fixed address itself.
  with_efa = var.efa_interfaces > 0
}

resource "aws_placement_group" "this" {
  count    = var.placement_strategy == null ? 0 : 1
  name     = local.name
  strategy = var.placement_strategy
  tags     = var.tags
}

resource "aws_launch_template" "this" {
  name_prefix            = "${local.name}-"
  description            = "kvfabric ${var.pool} nodes of ${var.cluster_name}"
  image_id               = var.image_id
  instance_type          = var.instance_type
  ebs_optimized          = true
  update_default_version = true
  user_data              = base64encode(var.user_data)

  iam_instance_profile {
    name = var.iam_instance_profile_name
  }

  # IMDSv2 only; one hop, so containers on the node cannot reach the node's credentials.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  monitoring {
    enabled = true
  }

  # The primary interface on card 0 (device 0), then one EFA per further network card
  # (device 1), as AWS lays out P5 instances' EFA interfaces.
  dynamic "network_interfaces" {
    for_each = range(var.efa_interfaces)
    content {
      network_card_index          = network_interfaces.value
      device_index                = network_interfaces.value == 0 ? 0 : 1
      interface_type              = "efa"
      subnet_id                   = var.subnet_id
      security_groups             = var.security_group_ids
      associate_public_ip_address = false
      delete_on_termination       = true
    }
  }

  placement {
    availability_zone = var.availability_zone
    group_name        = var.placement_strategy == null ? null : aws_placement_group.this[0].name
  }

  dynamic "instance_market_options" {
    for_each = var.market_type == null ? [] : [var.market_type]
    content {
      market_type = instance_market_options.value
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { "kvfabric:pool" = var.pool })
  }
  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { "kvfabric:pool" = var.pool })
  }
  tags = var.tags
}

resource "aws_instance" "this" {
  count = var.node_count

  launch_template {
    id      = aws_launch_template.this.id
    version = aws_launch_template.this.latest_version
  }

  subnet_id                   = local.with_efa ? null : var.subnet_id
  vpc_security_group_ids      = local.with_efa ? null : var.security_group_ids
  private_ip                  = local.with_efa || length(var.private_ips) == 0 ? null : var.private_ips[count.index]
  associate_public_ip_address = local.with_efa ? null : false

  # Repeated from the launch template so that they hold even where a template version
  # drifts, and so a reader of the instance sees them.
  ebs_optimized        = true
  monitoring           = true
  iam_instance_profile = var.iam_instance_profile_name
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    encrypted             = true
    kms_key_id            = var.kms_key_arn
    volume_type           = "gp3"
    volume_size           = var.root_volume_gib
    delete_on_termination = true
  }

  dynamic "capacity_reservation_specification" {
    for_each = length(var.capacity_reservation_ids) > 0 || var.capacity_reservation_resource_group_arn != null ? [1] : []
    content {
      capacity_reservation_target {
        capacity_reservation_id = (
          length(var.capacity_reservation_ids) > 0
          # min(): past the last reservation the precondition below says why, not an index error.
          ? var.capacity_reservation_ids[min(floor(count.index / var.nodes_per_capacity_reservation), length(var.capacity_reservation_ids) - 1)]
          : null
        )
        capacity_reservation_resource_group_arn = length(var.capacity_reservation_ids) > 0 ? null : var.capacity_reservation_resource_group_arn
      }
    }
  }

  tags = merge(
    var.tags,
    { Name = "${local.name}-${count.index}", "kvfabric:pool" = var.pool },
    # Which reservation the node is in: for decode, its super-node (UltraServer).
    length(var.capacity_reservation_ids) == 0 ? {} : {
      "kvfabric:reservation" = tostring(floor(count.index / var.nodes_per_capacity_reservation))
    },
  )

  lifecycle {
    precondition {
      condition     = length(var.capacity_reservation_ids) == 0 || length(var.capacity_reservation_ids) * var.nodes_per_capacity_reservation >= var.node_count
      error_message = "Too few capacity reservations for the pool: one per nodes_per_capacity_reservation nodes (one Capacity Block per UltraServer)."
    }
    precondition {
      condition     = length(var.private_ips) == 0 || (!local.with_efa && length(var.private_ips) >= var.node_count)
      error_message = "private_ips needs one address per node, and a pool without EFA."
    }
    precondition {
      condition     = var.placement_strategy != "spread" || var.node_count <= 7
      error_message = "A spread placement group holds at most 7 instances per zone."
    }
  }
}
