{{/*
Names: the RayService is named after the release (plus the chart name unless the release
already holds it), cut to 47 characters: KubeRay appends a 6-character suffix for its
RayCluster and "-serve-svc" for its Service, and refuses longer names.
*/}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The model folder's volume source (empty when args.model needs none). */}}
{{- define "tandem.modelVolume" -}}
{{- $v := .Values.modelVolume -}}
{{- if and $v.persistentVolumeClaim $v.hostPath -}}
{{- fail "modelVolume: give persistentVolumeClaim or hostPath, not both" -}}
{{- else if $v.persistentVolumeClaim -}}
persistentVolumeClaim:
  claimName: {{ $v.persistentVolumeClaim }}
  readOnly: true
{{- else if $v.hostPath -}}
hostPath:
  path: {{ $v.hostPath }}
  type: Directory
{{- end -}}
{{- end -}}

{{/*
One Serve deployment of the Tandem app: (list name pool). autoscaling_config, when given,
replaces num_replicas (Serve refuses both). Numbers go through toYaml or int: Helm holds them
as floats, which print as 1e+06 otherwise.
*/}}
{{- define "tandem.deployment" -}}
{{- $name := index . 0 -}}
{{- $pool := index . 1 -}}
- name: {{ $name }}
  {{- if $pool.autoscaling_config }}
  autoscaling_config:
    {{- toYaml $pool.autoscaling_config | nindent 4 }}
  {{- else if hasKey $pool "num_replicas" }}
  num_replicas: {{ int $pool.num_replicas }}
  {{- end }}
  {{- with omit $pool "num_replicas" "autoscaling_config" "ray_actor_options" }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $pool.ray_actor_options }}
  ray_actor_options:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
The Serve config KubeRay deploys (serveConfigV2): configs/serve.yaml's app, listening on
0.0.0.0:8000 inside the pods (and gRPC on grpc.port when enabled). Colocated mode has no
PrefillPool.
*/}}
{{- define "tandem.serveConfig" -}}
proxy_location: {{ .Values.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: 8000
{{- if .Values.grpc.enabled }}
grpc_options:
  port: {{ int .Values.grpc.port }}
  grpc_servicer_functions:
    - cluster.router.grpc_servicer.add_tandem_servicer
{{- end }}
applications:
  - name: tandem
    route_prefix: /
    import_path: cluster.router.app:build_app
    {{- with .Values.runtimeEnv }}
    runtime_env:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    args:
      {{- toYaml .Values.args | nindent 6 }}
    deployments:
      {{- include "tandem.deployment" (list "Router" .Values.router) | nindent 6 }}
      {{- if ne .Values.args.mode "colocated" }}
      {{- include "tandem.deployment" (list "PrefillPool" .Values.prefill) | nindent 6 }}
      {{- end }}
      {{- include "tandem.deployment" (list "DecodePool" .Values.decode) | nindent 6 }}
{{- end -}}

{{/*
A Ray pod's template: (dict "root" $ "group" <head or worker group values> "container" name
"head" bool "gpus" n). Every pod gets the image, the API key and the model volume: Serve
may place the Router and the pools on any of them.
*/}}
{{- define "tandem.podTemplate" -}}
{{- $root := .root -}}
{{- $group := .group -}}
{{- $volume := include "tandem.modelVolume" $root -}}
{{- $resources := deepCopy ($group.resources | default dict) -}}
{{- if .gpus -}}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" .gpus) ($resources.limits | default dict)) -}}
{{- end -}}
metadata:
  labels:
    {{- include "tandem.labels" $root | nindent 4 }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "tandem.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- if .head }}
      ports:
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: serve, containerPort: 8000}
        {{- if $root.Values.grpc.enabled }}
        - {name: grpc, containerPort: {{ int $root.Values.grpc.port }}}
        {{- end }}
      {{- end }}
      {{- with $root.Values.apiKey.secretName }}
      env:
        - name: TANDEM_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ . }}
              key: {{ $root.Values.apiKey.secretKey }}
      {{- end }}
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $volume }}
      volumeMounts:
        - name: model
          mountPath: {{ $root.Values.modelVolume.mountPath }}
          readOnly: true
      {{- end }}
  {{- if $volume }}
  volumes:
    - name: model
      {{- $volume | nindent 6 }}
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
