resource "kubernetes_namespace_v1" "megatrain" {
  metadata {
    name   = var.namespace
    labels = { "app.kubernetes.io/part-of" = "megatrain" }
  }
}

# The flow-run pods (one per campaign flow run, started by the worker from the base job template)
# submit each stage as a ConfigMap + headless Service + Indexed Job (tasks/kubernetes.py), wait
# for the Job and delete all three afterwards.
resource "kubernetes_service_account_v1" "flow_runs" {
  metadata {
    name      = var.service_account
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
}

resource "kubernetes_role_v1" "stage_jobs" {
  metadata {
    name      = "megatrain-stage-jobs"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }

  rule {
    api_groups = [""]
    resources  = ["configmaps", "services"]
    verbs      = ["create", "get", "delete"]
  }

  rule {
    api_groups = ["batch"]
    resources  = ["jobs"]
    verbs      = ["create", "get", "list", "watch", "delete"]
  }

  rule {
    api_groups = ["batch"]
    resources  = ["jobs/status"]
    verbs      = ["get"]
  }

  # what a stage's pods are doing, for the flow's logs when a Job fails
  rule {
    api_groups = [""]
    resources  = ["pods", "pods/log"]
    verbs      = ["get", "list", "watch"]
  }
}

resource "kubernetes_role_binding_v1" "stage_jobs" {
  metadata {
    name      = "megatrain-stage-jobs"
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.stage_jobs.metadata[0].name
  }
  subject {
    kind      = "ServiceAccount"
    name      = kubernetes_service_account_v1.flow_runs.metadata[0].name
    namespace = kubernetes_namespace_v1.megatrain.metadata[0].name
  }
}
