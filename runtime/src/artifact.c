/* placeholder */
typedef int ekv_placeholder_artifact;
