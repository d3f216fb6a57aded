# Prefect: a server in the namespace unless var.prefect_api_url names one, and a Kubernetes
# worker polling the work pool. The worker chart creates the pool and keeps its base job template
# equal to infra/k8s/base-job-template.json (the one file both the chart and `prefect work-pool
# create --base-job-template` read).
locals {
  install_server  = var.prefect_api_url == ""
  prefect_api_url = local.install_server ? "http://prefect-server.${var.namespace}.svc.cluster.local:4200/api" : var.prefect_api_url
}

resource "helm_release" "prefect_server" {
  count      = local.install_server ? 1 : 0
  name       = "prefect-server"
  repository = "https://prefecthq.github.io/prefect-helm"
  chart      = "prefect-server"
  version    = var.prefect_server_chart_version
  namespace  = kubernetes_namespace_v1.megatrain.metadata[0].name

  # API and UI behind basic auth from the generated secret (security.tf): no anonymous access
  values = [yamlencode({
    server = {
      basicAuth = { enabled = true, existingSecret = kubernetes_secret_v1.prefect_auth.metadata[0].name }
      uiConfig  = { prefectUiApiUrl = "${var.prefect_ui_url}/api" }
    }
  })]
}

resource "helm_release" "prefect_worker" {
  name       = "prefect-worker"
  repository = "https://prefecthq.github.io/prefect-helm"
  chart      = "prefect-worker"
  version    = var.prefect_worker_chart_version
  namespace  = kubernetes_namespace_v1.megatrain.metadata[0].name

  values = [yamlencode({
    worker = {
      replicaCount    = var.worker_replicas
      apiConfig       = "server"
      serverApiConfig = { apiUrl = local.prefect_api_url }
      # the server's auth string (security.tf), sent with every API call
      basicAuth = { enabled = true, existingSecret = kubernetes_secret_v1.prefect_auth.metadata[0].name }
      config = {
        type     = "kubernetes"
        workPool = var.work_pool_name
        baseJobTemplate = {
          configuration = file("${path.module}/../k8s/base-job-template.json")
        }
      }
    }
  })]

  depends_on = [helm_release.prefect_server]
}
