output "namespace" {
  value = kubernetes_namespace_v1.megatrain.metadata[0].name
}

output "work_pool_name" {
  value = var.work_pool_name
}

output "prefect_api_url" {
  description = "PREFECT_API_URL for `prefect deploy --name cluster` (from inside the cluster; port-forward from outside)"
  value       = local.prefect_api_url
}

output "redis_url" {
  description = "reliability.redis_url of the campaign"
  value       = "redis://${kubernetes_service_v1.redis.metadata[0].name}:${local.redis_port}/0"
}

output "dask_address" {
  description = "data.dask_address of the campaign (data.engine=dask)"
  value       = "tls://${kubernetes_service_v1.dask_scheduler.metadata[0].name}:${local.dask_scheduler_port}"
}

output "prefect_ui_password" {
  description = "the Prefect UI's password (user admin): terraform output -raw prefect_ui_password"
  value       = random_password.prefect_ui.result
  sensitive   = true
}
