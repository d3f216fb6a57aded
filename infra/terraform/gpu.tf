# NVIDIA's device plugin advertises nvidia.com/gpu on the GPU nodes (the resource the stage Jobs
# request). Managed GPU node pools and the GPU operator run it already: off by default.
resource "helm_release" "nvidia_device_plugin" {
  count      = var.install_nvidia_device_plugin ? 1 : 0
  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = var.nvidia_device_plugin_chart_version
  namespace  = "kube-system"
}
