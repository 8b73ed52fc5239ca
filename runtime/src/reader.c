/* placeholder */
typedef int ekv_placeholder_reader;
