{{- define "ferry.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ferry.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "ferry.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Names shared by the operator's RBAC and the worker objects it creates. */}}
{{- define "ferry.operatorServiceAccount" -}}{{ include "ferry.fullname" . }}-operator{{- end -}}
{{- define "ferry.workerServiceAccount" -}}ferry-worker{{- end -}}
{{- define "ferry.workerClusterRole" -}}{{ include "ferry.fullname" . }}-worker{{- end -}}
{{- define "ferry.reporterClusterRole" -}}{{ include "ferry.fullname" . }}-weights-reporter{{- end -}}
{{- define "ferry.referencesPolicy" -}}{{ include "ferry.fullname" . }}-references{{- end -}}
{{- define "ferry.fillPolicy" -}}{{ include "ferry.fullname" . }}-node-cache-fill{{- end -}}
{{- define "ferry.admissionPolicies" -}}
{{- $names := list (include "ferry.referencesPolicy" .) (include "ferry.reporterClusterRole" .) -}}
{{- if .Values.nodeCache.enabled }}{{ $names = append $names (include "ferry.fillPolicy" .) }}{{ end -}}
{{- join "," $names -}}
{{- end -}}
