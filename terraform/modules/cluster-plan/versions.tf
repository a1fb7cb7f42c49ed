# A pure module: no providers, no resources, only variables -> locals -> outputs, so
# `terraform init`, `terraform test` and `terraform apply` run offline.
terraform {
  # 1.9: variable validations that refer to other variables (decode_super_node_size).
  required_version = ">= 1.9"
}
